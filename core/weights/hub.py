"""Fetch a model from the Hugging Face Hub into the shared HF cache, only the files Ember reads.

`split_gguf_spec` reads the `org/name:FILE.gguf` spelling. `cached_snapshot` finds
a complete snapshot in the cache without any network call (the resolver asks it
first); `download_snapshot` fetches one with huggingface_hub's `snapshot_download`
(its progress bars, a dropped connection resumed with a Range request, `HF_TOKEN`), after asking
the Hub which files the revision holds:
  - a safetensors model: config.json, generation_config.json, the tokenizer files
    and every top-level `*.safetensors` with its index (never README, *.bin, *.pt);
  - with a GGUF file named: that one file.
Every failure is a one-line `HubDownloadError` naming the repo id and revision.

The environment is read per call (`HF_ENDPOINT`, `HF_HUB_OFFLINE`, the cache from
`hf_hub_cache_dir()`): huggingface_hub reads its own copies once, at import.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import HubDownloadError

DEFAULT_ENDPOINT = "https://huggingface.co"

# Top-level files a safetensors model needs besides its weights.
AUX_FILES = frozenset({
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
})


def hub_endpoint() -> str:
    """The Hub's address: `HF_ENDPOINT` at call time, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) at call time, spelled as huggingface_hub accepts it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def split_gguf_spec(model_id: str) -> tuple[str, str | None]:
    """`org/name:FILE.gguf` -> ("org/name", "FILE.gguf"); anything else -> (model_id, None)."""
    head, sep, tail = model_id.rpartition(":")
    if sep and head and tail.lower().endswith(".gguf") and "/" in head and not Path(model_id).exists():
        return head, tail
    return model_id, None


def is_valid_repo_id(repo_id: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return repo_id.count("/") == 1


def wanted_files(names: list[str], gguf_file: str | None) -> list[str]:
    """The files of a repo Ember fetches: the named GGUF file, else the safetensors model's."""
    if gguf_file is not None:
        return [gguf_file] if gguf_file in names else []
    top = [n for n in names if "/" not in n]
    weights = [n for n in top if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")]
    if not any(n.endswith(".safetensors") for n in weights):
        return []
    return sorted(n for n in top if n in AUX_FILES) + sorted(weights)


def cached_snapshot(repo_id: str, revision: str | None, hub_cache: Path, gguf_file: str | None) -> Path:
    """The cached snapshot of `repo_id` at `revision`, complete for what Ember needs, without any network call.

    Raises huggingface_hub's `LocalEntryNotFoundError` (or its `IncompleteSnapshotError`)
    when the cache does not hold it.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = None
    try:  # huggingface_hub >= 2.x keeps the tree listing: check the snapshot holds every file needed
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:
        get_cached_repo_tree = None
    if get_cached_repo_tree is not None:
        try:
            names = [f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=hub_cache)]
            patterns = wanted_files(names, gguf_file) or None
        except CachedRepoTreeNotFoundError:
            pass
    snapshot = Path(snapshot_download(
        repo_id, revision=revision, cache_dir=hub_cache, local_files_only=True, allow_patterns=patterns,
    ))
    if gguf_file is not None and not (snapshot / gguf_file).is_file():
        raise LocalEntryNotFoundError(f"snapshot {str(snapshot)!r} has no {gguf_file}")
    return snapshot


def download_snapshot(
    repo_id: str, revision: str | None, hub_cache: Path, gguf_file: str | None = None, progress: bool = True
) -> Path:
    """Fetch what Ember needs of `repo_id` at `revision` into `hub_cache`; return the snapshot directory.

    Raises `HubDownloadError` (one line) on every failure.
    """
    from huggingface_hub import HfApi, snapshot_download

    endpoint = hub_endpoint()

    def fail(reason: str, message: str) -> HubDownloadError:
        return HubDownloadError(repo_id, revision, reason, message)

    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise _classify(exc, fail, endpoint) from exc
    siblings = {s.rfilename: s.size for s in (info.siblings or [])}
    names = sorted(siblings)
    files = wanted_files(names, gguf_file)
    if not files:
        ggufs = [n for n in names if n.lower().endswith(".gguf")]
        if gguf_file is not None:
            has = f"its .gguf files: {', '.join(ggufs)}" if ggufs else "it has no .gguf files"
            raise fail("no-gguf-file", f"the repository has no file {gguf_file!r}; {has}")
        hint = (f"; to load a GGUF file, name it: {repo_id}:{ggufs[0]} (or --gguf-file {ggufs[0]})" if ggufs
                else "; pass `org/name:FILE.gguf` for a GGUF file")
        raise fail("no-weights", f"no *.safetensors weights Ember can read; it holds {', '.join(names) or 'nothing'}"
                   f"{hint}")
    needed = sum(siblings.get(n) or 0 for n in files)
    tqdm_class = None if progress else _quiet_tqdm()
    try:
        snapshot = snapshot_download(
            repo_id, revision=revision, cache_dir=hub_cache, allow_patterns=files, endpoint=endpoint,
            tqdm_class=tqdm_class,
        )
    except Exception as exc:
        if _errno_in_chain(exc) == errno.ENOSPC:
            size = f"; the files need {needed / 2**20:.1f} MiB" if needed else ""
            raise fail("disk-full", f"no space left on the device of {str(hub_cache)!r}{size}: free some space "
                       "or point HF_HUB_CACHE at a larger disk") from exc
        raise _classify(exc, fail, endpoint) from exc
    return Path(snapshot)


def _classify(exc: Exception, fail, endpoint: str) -> Exception:
    """A huggingface_hub or network error (or one it wraps) as a one-line `HubDownloadError`;
    anything else as it is."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    for e in _exception_chain(exc):
        if isinstance(e, GatedRepoError):
            return fail("gated", "the repository is gated or private and the request was not authorised: set HF_TOKEN "
                        "to a token that can read it, and accept the model's terms on its Hub page")
        if isinstance(e, RevisionNotFoundError):
            return fail("revision-not-found", "the repository has no such revision (branch, tag or commit)")
        if isinstance(e, RepositoryNotFoundError):
            return fail("not-found", "no such repository (or it is private: set HF_TOKEN to a token that can read it)")
        if isinstance(e, HfHubHTTPError):
            status = getattr(getattr(e, "response", None), "status_code", None)
            if status in (401, 403):
                return fail("gated", f"access refused (HTTP {status}): set HF_TOKEN to a token that can read the "
                            "repository, and accept the model's terms on its Hub page")
            if status == 404:
                return fail("not-found", "not found (HTTP 404)")
            return fail("http-error", f"the Hub at {endpoint} answered HTTP {status}; try again later")
    if _is_network_error(exc):
        return fail("no-network", f"cannot reach the Hub at {endpoint} ({type(exc).__name__}); check the network "
                    "(or HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to use only the local HF cache")
    return exc


def _exception_chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _errno_in_chain(exc: BaseException) -> int | None:
    for e in _exception_chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
    return None


def _network_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        names = ("ConnectError", "ConnectionError", "TimeoutException", "Timeout", "NetworkError", "RemoteProtocolError")
        for name in names:
            cls = getattr(mod, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                types.append(cls)
    return tuple(types)


def _is_network_error(exc: BaseException) -> bool:
    types = _network_error_types()
    return any(isinstance(e, types) for e in _exception_chain(exc))


def _quiet_tqdm():
    from huggingface_hub.utils import tqdm

    class QuietTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietTqdm


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def download_adapter(repo_id: str, revision: str | None, hub_cache: Path) -> Path:
    """A PEFT adapter repository's ``adapter_config.json`` and ``adapter_model.safetensors``
    (nothing else) in the HF cache, from the cache when it holds them, else from the Hub;
    the snapshot directory. `HubDownloadError` (one line) on every failure."""
    from huggingface_hub import HfApi, snapshot_download

    if not is_valid_repo_id(repo_id):
        raise HubDownloadError(repo_id, revision, "bad-id", "not a Hub repository id (org/name)")
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache, local_files_only=True,
                                          allow_patterns=list(ADAPTER_FILES)))
        if all((snapshot / name).is_file() for name in ADAPTER_FILES):
            return snapshot
    except Exception:  # noqa: BLE001 - not cached: ask the Hub
        pass
    endpoint = hub_endpoint()

    def fail(reason: str, message: str) -> HubDownloadError:
        return HubDownloadError(repo_id, revision, reason, message)

    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
        names = {s.rfilename for s in (info.siblings or [])}
        missing = [name for name in ADAPTER_FILES if name not in names]
        if missing:
            raise fail("no-adapter", f"the repository has no {', '.join(missing)} (a PEFT adapter saved with "
                       "safetensors); it holds " + (", ".join(sorted(names)) or "nothing"))
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=hub_cache,
                                     allow_patterns=list(ADAPTER_FILES), endpoint=endpoint, tqdm_class=_quiet_tqdm())
    except HubDownloadError:
        raise
    except Exception as exc:
        raise _classify(exc, fail, endpoint) from exc
    return Path(snapshot)
