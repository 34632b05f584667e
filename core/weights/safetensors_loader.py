"""Read weights from a Hugging Face style directory of safetensors files.

Pickle checkpoints (`pytorch_model.bin`, `*.pt`, ...) can run arbitrary code
when loaded, so they are never opened: a directory that has only those raises
`UnsafeCheckpointError` instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, NoReturn

import torch
from safetensors import safe_open

from .errors import CheckpointNotFoundError, UnsafeCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    `CheckpointNotFoundError` if there are no weights at all, and `ValueError`
    for an index that names missing shards or tensors, or a tensor name that
    appears in two files.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"Model directory {str(model_dir)!r} does not exist or is not a directory")
    return _iter_files(_plan_files(model_dir))


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
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(index)!r} is not a valid safetensors index (needs a 'weight_map' object): {exc}") from exc
    names_by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names_by_shard.setdefault(shard, []).append(name)
    plan = []
    for shard in sorted(names_by_shard):
        path = index.parent / shard
        if not path.is_file():
            raise ValueError(f"{str(index)!r} lists shard {shard!r}, which does not exist in {str(index.parent)!r}")
        plan.append((path, names_by_shard[shard]))
    return plan


def _iter_files(plan: list[tuple[Path, list[str] | None]]) -> Iterator[NamedTensor]:
    seen: dict[str, Path] = {}
    for path, names in plan:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            available = list(f.keys())
            if names is None:
                names = available
            else:
                missing = sorted(set(names) - set(available))
                if missing:
                    raise ValueError(
                        f"The index says {str(path)!r} holds {missing[:3]} (and {len(missing)} in all), "
                        "but the file does not contain them"
                    )
            for name in names:
                if name in seen:
                    raise ValueError(f"Tensor {name!r} appears in both {str(seen[name])!r} and {str(path)!r}")
                seen[name] = path
                yield NamedTensor(name, f.get_tensor(name))


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
