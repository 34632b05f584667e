"""One rank's shard of a model, read from safetensors without the rest.

Every rank opens the checkpoint's files itself and reads, tensor by tensor, only
the rows or columns its modules hold (``safe_open(...).get_slice``, which reads
those bytes from the memory-mapped file): no process materialises the whole model.
A GGUF model has been converted once into a safetensors directory in Ember's cache
(``ember.weights.resolve_model``, dequantized tensor by tensor, in the driver before
the workers start); the ranks slice that directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ember.models.base import BaseCausalLM
from ember.models.loader import get_model_class
from ember.models.parallel.layers import WeightSlice, checkpoint_slice, resident_weight_bytes
from ember.models.parallel.state import ParallelContext
from ember.weights import InvalidCheckpointError
from ember.weights.safetensors_loader import _plan_files, check_safetensors_header

logger = logging.getLogger(__name__)


def iter_safetensors_slices(
    model_dir: Path, slice_of: Callable[[str], WeightSlice | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every checkpoint tensor ``slice_of(name)`` keeps (None:
    skipped unread), each cut to its slice while reading. Files are chosen and
    checked as ``ember.weights.iter_safetensors`` does."""
    plan = _plan_files(Path(model_dir))
    for path, _ in plan:
        check_safetensors_header(path)
    for path, names in plan:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names if names is not None else list(f.keys()):
                    part = slice_of(name)
                    if part is None:
                        continue
                    view = f.get_slice(name)
                    if part.dim is None:
                        tensor = view[:]
                    elif part.dim == 0:
                        tensor = view[part.start : part.stop]
                    else:
                        tensor = view[:, part.start : part.stop]
                    yield name, tensor
        except SafetensorError as exc:
            raise InvalidCheckpointError(f"{str(path)!r} is not a valid safetensors file: {exc}") from exc


def check_parallel_model(hf_config, architectures, quantization: object = None) -> None:
    """ValueError naming what this rank cannot shard: an architecture without
    ``supports_parallel``, or a quantized checkpoint (not sharded yet)."""
    cls = get_model_class(hf_config, architectures)
    if not getattr(cls, "supports_parallel", False):
        raise ValueError(
            f"architecture {cls.__name__} does not support tensor or pipeline parallelism "
            "(it takes no parallel= argument)"
        )
    quant = quantization or getattr(hf_config, "quantization_config", None)
    if quant:
        raise ValueError(
            f"a quantized model ({quant!r:.80}) cannot run with tensor or pipeline parallelism yet: "
            "serve it with tensor_parallel_size=1 and pipeline_parallel_size=1"
        )


def load_model_shard(model_dir: Path, hf_config, backend, attention, dtype: torch.dtype, architectures,
                     ctx: ParallelContext) -> BaseCausalLM:
    """This rank's model (``ember.models.loader.load_model``'s steps on its shard)."""
    check_parallel_model(hf_config, architectures)
    cls = get_model_class(hf_config, architectures)
    compute_dtype = backend.compute_dtype(dtype)
    weight_dtype = backend.weight_dtype(dtype)
    model = cls(hf_config, attention, compute_dtype, dtype=weight_dtype, device=backend.device, parallel=ctx)
    model.load_weights(
        (name, tensor.to(dtype).to(weight_dtype))
        for name, tensor in iter_safetensors_slices(model_dir, lambda name: checkpoint_slice(model, name))
    )
    model.eval()
    model.set_linear_op(backend.linear_op())
    backend.prepare_model(model, dtype)
    model.set_layer_ops(backend.layer_ops(compute_dtype))
    logger.info(
        "rank %d (tp %d/%d, pp %d/%d): layers %d-%d, %.1f MiB of weights", ctx.rank, ctx.tp_rank, ctx.tp_size,
        ctx.pp_rank, ctx.pp_size, model.layer_range[0], model.layer_range[1] - 1, resident_weight_bytes(model) / 2**20,
    )
    return model
