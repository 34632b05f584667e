"""From a resolved model directory to a loaded model on a backend."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from ember.backend import BaseAttention, BaseBackend
from ember.models.base import BaseCausalLM
from ember.plugin.registry import Registry
from ember.weights import InvalidCheckpointError, iter_safetensors

logger = logging.getLogger(__name__)


def read_json_object(path: Path) -> dict:
    """A model file that holds one JSON object (config.json, generation_config.json);
    `InvalidCheckpointError` naming the file if it is not one, OSError if unreadable."""
    try:
        values = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidCheckpointError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise InvalidCheckpointError(f"{str(path)!r} is not a JSON object but {type(values).__name__}")
    return values


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    """The model's config.json; `InvalidCheckpointError` (a `ValueError`) naming the file if it
    is not a JSON object, `ValueError` for anything else transformers refuses in it."""
    path = Path(model_dir) / "config.json"
    try:
        read_json_object(path)
    except OSError:
        pass  # not readable here: transformers says what is wrong below
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ValueError(f"could not read the model config {str(path)!r}: {exc}") from exc


def model_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def prefill_context_scale(hf_config: PretrainedConfig) -> float | None:
    """The context length at which a token's attention costs as much as its pass
    through the linear layers (SchedulerConfig.prefill_context_scale): per layer,
    2 x (linear weights) FLOPs against 4 x heads x head_dim per context token. None
    when the config does not say enough (a decoder of the Llama family does)."""
    try:
        hidden, inter = int(hf_config.hidden_size), int(hf_config.intermediate_size)
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    linear = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    return linear / (2 * heads * head_dim) if linear > 0 and heads * head_dim > 0 else None


def get_model_class(hf_config: PretrainedConfig, architectures: Registry) -> type[BaseCausalLM]:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in architectures:
            return architectures.get(name)
    supported = ", ".join(architectures.names()) or "none"
    raise ValueError(
        f"model architecture {names or '(none in config.json)'} is not supported; "
        f"supported architectures: {supported} (install a plugin that registers it)"
    )


def load_model(
    model_dir: Path,
    hf_config: PretrainedConfig,
    backend: BaseBackend,
    attention: BaseAttention,
    dtype: torch.dtype,
    architectures: Registry,
) -> BaseCausalLM:
    cls = get_model_class(hf_config, architectures)
    compute_dtype = backend.compute_dtype(dtype)
    weight_dtype = backend.weight_dtype(dtype)
    model = cls(hf_config, attention, compute_dtype, dtype=weight_dtype, device=backend.device)
    # rounded to the model's dtype first: a bf16 model computes with bf16 numbers
    # whatever dtype the backend keeps them in
    model.load_weights(
        (name, tensor.to(dtype).to(weight_dtype)) for name, tensor in iter_safetensors(Path(model_dir))
    )
    model.eval()
    model.set_linear_op(backend.linear_op())
    backend.prepare_model(model, dtype)
    fused = model.set_layer_ops(backend.layer_ops(compute_dtype))
    logger.info(
        "loaded %s from %s: dtype %s, weights kept in %s, compute dtype %s, on %s; fused layer ops: %s",
        cls.__name__, model_dir, dtype, weight_dtype, compute_dtype, backend.describe(), ", ".join(fused) or "none",
    )
    return model
