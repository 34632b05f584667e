"""From a resolved model directory to a loaded model on a backend."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from ember.models.base import BaseCausalLM
from ember.config import MODEL_IMPLS
from ember.models.layers import Linear
from ember.multimodal.config import multimodal_config, text_view
from ember.models.transformers_impl import TransformersCausalLM, transformers_class
from ember.plugin.backend import BaseAttention, BaseBackend
from ember.plugin.quantizer import BaseQuantizer, resolve_ops
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
    """The model's config.json (a vision-language model's as its decoder's, `text_view`); `InvalidCheckpointError` (a `ValueError`) naming the file if it
    is not a JSON object, `ValueError` for anything else transformers refuses in it."""
    path = Path(model_dir) / "config.json"
    try:
        read_json_object(path)
    except OSError:
        pass  # not readable here: transformers says what is wrong below
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ValueError(f"could not read the model config {str(path)!r}: {exc}") from exc
    return text_view(config)  # a vision-language checkpoint: its decoder's figures (ember.multimodal.config)


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


def get_model_class(
    hf_config: PretrainedConfig, architectures: Registry, model_impl: str = "auto",
) -> type[BaseCausalLM]:
    """The class that runs the model. ``model_impl`` (``EngineConfig.model_impl``):
    ``"ember"`` the native class registered for the config's architecture, else a
    ValueError listing the supported ones; ``"transformers"`` the transformers fallback
    (``ember.models.transformers_impl``) whatever is registered; ``"auto"`` the native
    class where there is one, else the fallback. The fallback refuses, naming the
    architecture, what transformers cannot run behind Ember's paged attention."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    names = list(getattr(hf_config, "architectures", None) or [])
    if model_impl != "transformers":
        for name in names:
            if name in architectures:
                return architectures.get(name)
    supported = ", ".join(architectures.names()) or "none"
    unsupported = (f"model architecture {names or '(none in config.json)'} is not supported; "
                   f"supported architectures: {supported} (install a plugin that registers it)")
    if model_impl == "ember":
        raise ValueError(unsupported)
    if multimodal_config(hf_config) is not None:  # the fallback runs decoders over tokens only
        vlms = ", ".join(n for n in architectures.names() if getattr(architectures.get(n), "supports_images", False))
        raise ValueError(f"model architecture {names} is a vision-language model Ember does not run yet "
                         f"(vision-language architectures: {vlms or 'none'}; docs/multimodal.md); the transformers "
                         "fallback (--model-impl transformers) runs text-only decoders")
    try:
        transformers_class(hf_config)
    except ValueError as exc:
        if model_impl == "transformers":
            raise
        raise ValueError(f"{unsupported}; nor can the transformers fallback run it: {exc}") from None
    return TransformersCausalLM


def describe_model_impl(cls: type[BaseCausalLM], hf_config: PretrainedConfig) -> str:
    """What logs say runs the model: the native class, or the transformers fallback and the class it wraps."""
    if issubclass(cls, TransformersCausalLM):
        return f"transformers fallback ({transformers_class(hf_config).__name__} through transformers' modeling code)"
    return f"ember (native {cls.__name__})"


def load_model(
    model_dir: Path,
    hf_config: PretrainedConfig,
    backend: BaseBackend,
    attention: BaseAttention,
    dtype: torch.dtype,
    architectures: Registry,
    quantizer: BaseQuantizer | None = None,
    dequantize: bool = False,
    model_impl: str = "auto",
) -> BaseCausalLM:
    """``quantizer`` (``ember.plugin.quantizer.select_quantizer``): the linears it packs run
    through the backend's op for their format; ``dequantize``: a format the backend has
    no op for is loaded as float weights instead of refused (docs/quantization.md);
    ``model_impl``: which implementation runs it (`get_model_class`)."""
    cls = get_model_class(hf_config, architectures, model_impl)
    logger.info("model implementation: %s (model_impl=%s)", describe_model_impl(cls, hf_config), model_impl)
    compute_dtype = backend.compute_dtype(dtype)
    weight_dtype = backend.weight_dtype(dtype)
    ops = resolve_ops(quantizer, backend, compute_dtype, dequantize) if quantizer is not None else {}
    model = cls(hf_config, attention, compute_dtype, dtype=weight_dtype, device=backend.device)
    weights = iter_safetensors(Path(model_dir))
    if quantizer is not None and getattr(model, "supports_images", False):
        raise ValueError(f"quantized weights for vision-language models ({cls.__name__}) are not supported yet "
                         f"(quantizer {quantizer.name!r}); load the float checkpoint")
    if quantizer is not None:
        try:
            parts = model.linear_parts()
        except NotImplementedError as exc:
            raise ValueError(f"{exc}: cannot load it with quantizer {quantizer.name!r}") from None
        weights = _route_quantized(weights, quantizer, parts, dtype)
        source = quantizer.embedding_source()
        if source is not None:  # a tied LM head kept quantized: the embedding reads its rows
            if source not in parts:
                raise ValueError(f"quantizer {quantizer.name!r}: the embedding's source {source!r} is not a linear "
                                 "of this model")
            try:
                model.embed_from(parts[source][0])
            except NotImplementedError as exc:
                raise ValueError(f"{exc}: cannot load it with quantizer {quantizer.name!r}") from None
    # rounded to the model's dtype first: a bf16 model computes with bf16 numbers
    # whatever dtype the backend keeps them in
    model.load_weights((name, tensor.to(dtype).to(weight_dtype)) for name, tensor in weights)
    if quantizer is not None:
        _install_quantized_ops(model, quantizer, ops, dtype, weight_dtype)
    model.eval()
    model.set_linear_op(backend.linear_op())
    backend.prepare_model(model, dtype)
    fused = model.set_layer_ops(backend.layer_ops(compute_dtype))
    logger.info(
        "loaded %s from %s: dtype %s, weights kept in %s, compute dtype %s, on %s; fused layer ops: %s",
        cls.__name__, model_dir, dtype, weight_dtype, compute_dtype, backend.describe(), ", ".join(fused) or "none",
    )
    total, packed, formats = model_weight_bytes(model)
    logger.info(
        "model weights resident: %.1f MiB%s", total / 2**20,
        f" ({packed / 2**20:.1f} MiB packed: {', '.join(f'{n} x {f}' for f, n in sorted(formats.items()))} "
        f"linears, quantizer {quantizer.describe()})" if formats else "",
    )
    return model


def model_weight_bytes(model: BaseCausalLM) -> tuple[int, int, dict[str, int]]:
    """(bytes of every weight the model holds, of which packed quantized weights, and the
    count of quantized linears by format). Each storage is counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type == "meta" or tensor.is_mkldnn:
            total += tensor.numel() * tensor.element_size() if tensor.is_mkldnn else 0
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    packed = 0
    formats: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.qweights is not None:
            packed += module.quantized_nbytes()
            formats[module.qweights[0].format] = formats.get(module.qweights[0].format, 0) + 1
    return total + packed, packed, formats


def _route_quantized(
    weights: Iterable[tuple[str, torch.Tensor]], quantizer: BaseQuantizer,
    parts: dict[str, tuple[Linear, int]], dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every checkpoint tensor through, except those of quantized linears: grouped
    by linear until the quantizer has them all, packed, and loaded into the linear's
    part here. A linear the quantizer leaves in float gets its weight passed through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    depth = max(s.count(".") for s in quantizer.tensor_suffixes) + 1
    for name, tensor in weights:
        prefix, suffix = _split_linear_name(name, parts, depth)
        target = parts.get(prefix)
        if target is None or suffix not in quantizer.tensor_suffixes:
            if target is not None and suffix == "bias" and target[0].bias is None and not tensor.any():
                continue  # GPTQ/AWQ writers store zero biases for linears that have none
            yield name, tensor
            continue
        group = pending.setdefault(prefix, {})
        group[suffix] = tensor
        if quantizer.is_complete(group):
            yield from _load_group(prefix, pending.pop(prefix), quantizer, target, dtype)
    for prefix, group in pending.items():
        yield from _load_group(prefix, group, quantizer, parts[prefix], dtype)


def _split_linear_name(name: str, parts: dict, depth: int) -> tuple[str, str]:
    """``(linear prefix, suffix)`` of a tensor name; suffixes may hold dots
    (bitsandbytes' ``weight.absmax``). The shortest suffix after a known linear wins."""
    pieces = name.split(".")
    for n in range(1, min(depth, len(pieces) - 1) + 1):
        prefix = ".".join(pieces[:-n])
        if prefix in parts:
            return prefix, ".".join(pieces[-n:])
    return name.rpartition(".")[0], pieces[-1]


def _load_group(prefix, group, quantizer, target, dtype) -> Iterator[tuple[str, torch.Tensor]]:
    weight = quantizer.create_weight(prefix, group, dtype)
    if weight is None:
        for suffix, tensor in group.items():
            yield f"{prefix}.{suffix}", tensor
        return
    module, index = target
    try:
        module.load_part(index, "weight", weight)
    except ValueError as exc:
        raise ValueError(f"{prefix}: {exc}") from None


def _install_quantized_ops(model, quantizer, ops, dtype, weight_dtype) -> None:
    for name, module in model.named_modules():
        if not (isinstance(module, Linear) and module.is_quantized):
            continue
        missing = module.missing_quantized_parts()
        if missing:
            raise ValueError(f"checkpoint is missing quantized part(s) {missing} of linear {name!r}")
        fmt = module.quant_parts[0].format
        if fmt not in ops:  # the quantizer made a format it did not declare
            raise ValueError(f"quantizer {quantizer.name!r} made {fmt!r} weights for {name!r}, not one of the "
                             f"formats it declares: {quantizer.weight_formats()}")
        op = ops[fmt]
        if op is None:
            module.set_dequantized(dtype, weight_dtype)
        else:
            module.set_quantized_op(op)
