"""Read weights from a Hugging Face style directory of safetensors files.

Pickle checkpoints (`pytorch_model.bin`, `*.pt`, ...) can run arbitrary code
when loaded, so they are never opened: a directory that has only those raises
`UnsafeCheckpointError` instead. A damaged file (empty, truncated, a header
that is not JSON or whose offsets do not fit) raises `InvalidCheckpointError`
naming it, before any tensor is read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import NamedTuple, NoReturn

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointNotFoundError, InvalidCheckpointError, UnsafeCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


class NamedTensor(NamedTuple):
    """One checkpoint tensor under its Hugging Face parameter name."""

    name: str
    tensor: torch.Tensor


def iter_safetensors(model_dir: Path) -> Iterator[NamedTensor]:
    """Yield every tensor of the checkpoint in `model_dir`, each exactly once.

    Files are chosen like transformers does: `model.safetensors` if present,
    else the shards listed by `model.safetensors.index.json` (each shard opened
    once, shards in name order), else every `*.safetensors` in the directory.
    Tensors are CPU tensors in their stored dtype and shape. Files are chosen
    and checked when this is called; tensors are read as the iterator advances.

    Raises `UnsafeCheckpointError` if only pickle checkpoints are present,
    `CheckpointNotFoundError` if there are no weights at all, and
    `InvalidCheckpointError` (a `ValueError`) for a damaged file, an index
    that names missing, absolute or `..` shards or missing tensors, or a
    tensor name that appears in two files.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"Model directory {str(model_dir)!r} does not exist or is not a directory")
    plan = _plan_files(model_dir)
    for path, _ in plan:
        check_safetensors_header(path)
    return _iter_files(plan)


def check_safetensors_header(path: Path) -> None:
    """Raise `InvalidCheckpointError` naming `path` unless its header is a JSON object whose
    tensors' data fits in the file. Reads only the header.

    A safetensors file is an 8-byte little-endian header length, that many bytes
    of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}}, plus an
    optional "__metadata__"), then the data the offsets point into. What this
    does not check (overlaps, shapes against offsets) the library reports when
    the file is opened, and `_iter_files` names the file then.
    """
    def invalid(problem: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"{str(path)!r} is not a valid safetensors file: {problem}")

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            raise invalid("it is empty (0 bytes)")
        if size < 8:
            raise invalid(f"it has only {size} bytes, fewer than the 8 of the header length")
        f.seek(0)
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise invalid(f"it is truncated: its header length says {header_len} bytes follow, the file has {size - 8}")
        if header_len > MAX_HEADER_BYTES:
            raise invalid(f"its header is {header_len} bytes, more than the {MAX_HEADER_BYTES} safetensors allows")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"its header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise invalid(f"its header is not a JSON object but {type(header).__name__}")
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise invalid(f"its header entry for tensor {name!r} has no valid data_offsets [begin, end]: "
                          f"{entry!r:.200}")
        data_end = max(data_end, offsets[1])
    data_size = size - 8 - header_len
    if data_end > data_size:
        raise invalid(f"it is truncated: its tensors need {data_end} bytes of data, the file holds {data_size}")


def _plan_files(model_dir: Path) -> list[tuple[Path, list[str] | None]]:
    """Return (file, tensor names to read or None for all) in reading order."""
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [(single, None)]
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _plan_from_index(index)
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if files:
        return [(p, None) for p in files]
    _raise_no_safetensors(model_dir)


def _plan_from_index(index: Path) -> list[tuple[Path, list[str] | None]]:
    """The shards `index` lists, each a file inside the index's directory.

    A shard must be named by a plain relative path: not absolute and without
    `..`, so that a downloaded index cannot point Ember at any other file on
    the machine; and the file must resolve (symlinks followed) inside the
    directory, or, for a Hugging Face hub cache snapshot, inside its
    repository's `blobs/` (snapshot files are symlinks to `../../blobs/`), so
    that a link shipped in a model archive cannot lead elsewhere either.
    """
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidCheckpointError(
            f"{str(index)!r} is not a valid safetensors index (needs a 'weight_map' object): {exc}"
        ) from exc
    if not isinstance(weight_map, dict):
        raise InvalidCheckpointError(
            f"{str(index)!r} is not a valid safetensors index: 'weight_map' is a {type(weight_map).__name__}, "
            "not an object of tensor name -> shard file"
        )
    roots = _shard_roots(index.parent)
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise InvalidCheckpointError(
                f"{str(index)!r} maps tensor {name!r} to {shard!r}, which is not a shard file name"
            )
        names_by_shard.setdefault(shard, []).append(name)
    plan = []
    for shard in sorted(names_by_shard):
        if not _is_plain_relative(shard):
            raise InvalidCheckpointError(
                f"{str(index)!r} lists shard {shard!r}, which is not a file name inside {str(index.parent)!r} "
                "(absolute paths and '..' are refused)"
            )
        path = index.parent / shard
        if not path.is_file():
            raise InvalidCheckpointError(
                f"{str(index)!r} lists shard {shard!r}, which does not exist in {str(index.parent)!r}"
            )
        resolved = path.resolve()
        if not any(resolved.is_relative_to(root) for root in roots):
            raise InvalidCheckpointError(
                f"{str(index)!r} lists shard {shard!r}, a link to {str(resolved)!r}, which is outside the model "
                f"directory {str(index.parent)!r}"
            )
        plan.append((path, names_by_shard[shard]))
    return plan


def _shard_roots(model_dir: Path) -> list[Path]:
    """Where an index's shards may lead: the model directory, and for a snapshot of the
    Hugging Face hub cache (``<repo>/snapshots/<commit>/``) its repository's ``blobs/``,
    where the snapshot's files are symlinks to."""
    root = model_dir.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _is_plain_relative(name: str) -> bool:
    """True for "model-00001.safetensors" or "sub/x.safetensors"; False for "", ".", absolute paths
    (POSIX or Windows, drive letters included) and any ".." component."""
    if not name or "\0" in name:
        return False
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            return False
    return PurePosixPath(name).parts not in ((), (".",))


def _iter_files(plan: list[tuple[Path, list[str] | None]]) -> Iterator[NamedTensor]:
    seen: dict[str, Path] = {}
    for path, names in plan:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                available = list(f.keys())
                if names is None:
                    names = available
                else:
                    missing = sorted(set(names) - set(available))
                    if missing:
                        raise InvalidCheckpointError(
                            f"The index says {str(path)!r} holds {missing[:3]} (and {len(missing)} in all), "
                            "but the file does not contain them"
                        )
                for name in names:
                    if name in seen:
                        raise InvalidCheckpointError(
                            f"Tensor {name!r} appears in both {str(seen[name])!r} and {str(path)!r}"
                        )
                    seen[name] = path
                    yield NamedTensor(name, f.get_tensor(name))
        except SafetensorError as exc:
            raise InvalidCheckpointError(f"{str(path)!r} is not a valid safetensors file: {exc}") from exc


def _raise_no_safetensors(model_dir: Path) -> NoReturn:
    pickles = sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        shown = ", ".join(pickles[:5]) + (f" (+{len(pickles) - 5} more)" if len(pickles) > 5 else "")
        raise UnsafeCheckpointError(
            f"{str(model_dir)!r} holds only pickle checkpoints ({shown}). Ember will not unpickle them, because "
            "loading a pickle can run arbitrary code. Convert the model to safetensors instead, e.g. with "
            "transformers: `model.save_pretrained(dir, safe_serialization=True)`, or use a GGUF file of the model."
        )
    ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
    hint = (
        f" It does contain {', '.join(ggufs)}: pass that .gguf file to `ember.weights.resolve_model` to convert it."
        if ggufs
        else ""
    )
    raise CheckpointNotFoundError(
        f"No weights found in {str(model_dir)!r}: looked for {SINGLE_FILE}, {INDEX_FILE} and *.safetensors.{hint}"
    )
