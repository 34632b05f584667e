"""The quantizer contract (docs/quantization.md): packed weights, the quantizers that
make them, and the backend ops that multiply by them.

Three parts meet here:

* :class:`QuantizedWeight` — the packed weight of one :class:`ember.models.layers.Linear`
  (or one part of a fused one). Its ``format`` names the packed form a kernel reads
  (``"int8"``, ``"int4"``, ``"gguf_q4_1"``, ...); ``shape`` is the logical
  ``(out_features, in_features)``; ``dequantize`` is the float reference every kernel
  is checked against.
* :class:`BaseQuantizer` — recognises a checkpoint's quantization (``quantization_config``
  in config.json) or is chosen by the user (``--quantize NAME``), and turns the
  checkpoint tensors of one linear into a :class:`QuantizedWeight`. Registered through
  the ``ember_register_quantizers`` hook.
* :class:`QuantizedLinearOp` — the backend's matrix product for one format
  (``BaseBackend.quantized_linear_op(format)``); a format the backend has no op for is
  refused with a message naming both, or dequantized at load when the user asks
  (``--dequantize``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

logger = logging.getLogger(__name__)

# TGI's --quantize names that Ember does not build: refused by name, not as unknown.
NOT_BUILT = {
    "eetq": "EETQ's int8 kernels are CUDA-only; --quantize int8 quantizes per channel at load on every backend",
    "exl2": "ExLlamaV2 checkpoints are not read",
    "marlin": "Marlin is a CUDA kernel for GPTQ/AWQ checkpoints; load them with gptq or awq",
    "bitsandbytes-fp4": "bitsandbytes FP4 is not read; NF4 (bitsandbytes-nf4) and int8 (bitsandbytes) are",
}


class QuantizedWeight(ABC):
    """The packed weight of one linear, logically ``(out_features, in_features)``.

    A subclass per packed form; ``format`` is what a backend's op is chosen by, so two
    subclasses with the same format must hold the same tensors. Invariants:
    ``dequantize(torch.float32)`` has shape ``shape`` and is the exact float value of
    the packed numbers (what the format's own library dequantizes to, in float32);
    the packed tensors are the only copy (no float weight is kept beside them).
    """

    format: ClassVar[str] = ""

    def __init__(self, shape: tuple[int, int]) -> None:
        out_features, in_features = (int(s) for s in shape)
        if out_features < 1 or in_features < 1:
            raise ValueError(f"a quantized weight needs a positive shape, got {tuple(shape)}")
        self.shape = (out_features, in_features)

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The packed tensors by name (what ``nbytes`` counts and ``to`` moves)."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``(out_features, in_features)`` in ``dtype``: computed in
        float32, then rounded once to ``dtype``."""

    @classmethod
    def concat(cls, parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
        """The parts of a fused linear (q, k, v or gate, up) joined along the output
        dimension, in order, as one weight of this class; None when they cannot be
        joined (different group sizes, different column orders), and the linear then
        runs its parts one by one. Default: None."""
        return None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(format={self.format!r}, shape={self.shape}, nbytes={self.nbytes})"


def check_parts(parts: Sequence[QuantizedWeight]) -> tuple[int, int]:
    """The joined shape of fused parts; ValueError when their input widths differ."""
    widths = {p.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"fused parts have different input widths: {[p.shape for p in parts]}")
    return sum(p.shape[0] for p in parts), widths.pop()


class QuantizedLinearOp(ABC):
    """A backend's product ``x @ W.T + b`` for weights of one ``format``.

    Built once per model load by ``BaseBackend.quantized_linear_op(format)`` for the
    compute dtype; nothing per token goes through a registry.
    """

    format: ClassVar[str] = ""
    #: the largest ``max|op(x) - F.linear(x, w)| / max|F.linear(x, w)|`` this op allows
    #: itself against its prepared weight's ``dequantize`` (``ember.testing.check_quantizer``
    #: holds it to that): about 1e-6 for float32 products, 2**-7 for bf16 activations
    max_relative_error: ClassVar[float] = 1e-5

    def prepare(self, weight: QuantizedWeight) -> QuantizedWeight:
        """Called once per weight at load: return the form this op reads (a repacked
        weight of the same ``format`` and ``shape`` whose ``dequantize`` is unchanged,
        or ``weight`` itself). The input is dropped afterwards. Default: ``weight``."""
        return weight

    @abstractmethod
    def __call__(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``(num_tokens, in_features)`` in the compute dtype -> ``(num_tokens,
        out_features)`` in the same dtype, equal to ``F.linear(x, weight.dequantize(x.dtype),
        bias)`` within the format's stated tolerance (docs/quantization.md)."""

    def embedding(self, ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """Rows ``ids`` (int64 ``(num_tokens,)``) of ``weight.dequantize(torch.float32)``,
        exactly: ``(num_tokens, in_features)`` float32. A token embedding that shares a
        tied LM head's quantized weight reads its rows here (``BaseQuantizer.
        embedding_source``). IndexError for an id outside ``[0, out_features)``.
        Default: the whole weight dequantized, then indexed."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
            raise IndexError(f"token ids must lie in [0, {weight.shape[0]})")
        return weight.dequantize(torch.float32)[ids]


class BaseQuantizer(ABC):
    """Turns a linear's checkpoint tensors into a :class:`QuantizedWeight`.

    Constructed once per model load as ``cls(quantization_config)``: the checkpoint's
    ``quantization_config`` mapping (config.json), or None when the user chose this
    quantizer for a float checkpoint (``--quantize NAME``). Raise ValueError naming
    any value of the config it does not support.

    The loader groups checkpoint tensors by linear: for ``<prefix>.<suffix>`` with
    ``suffix`` in ``tensor_suffixes`` and ``<prefix>`` a linear of the model, the
    tensors are collected until ``is_complete`` holds, then passed to
    ``create_weight``. Groups still incomplete at the end of the checkpoint are passed
    too (a linear the checkpoint left in float: return None).
    """

    #: the registry name, also ``--quantize NAME``
    name: ClassVar[str]
    #: ``quantization_config["quant_method"]`` values this quantizer reads
    quant_methods: ClassVar[tuple[str, ...]] = ()
    #: whether it quantizes a float checkpoint at load (``--quantize NAME`` without a
    #: ``quantization_config``)
    quantizes_float: ClassVar[bool] = False
    #: tensor names of one quantized linear, after its prefix
    tensor_suffixes: ClassVar[tuple[str, ...]] = ("weight",)
    #: the suffixes without which a group is not complete
    required_suffixes: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(self, quantization_config: Mapping[str, Any] | None = None) -> None:
        self.quantization_config = dict(quantization_config or {})

    @classmethod
    def accepts(cls, quantization_config: Mapping[str, Any]) -> bool:
        """Whether this quantizer reads a checkpoint with this config (several may share
        a ``quant_method``, as bitsandbytes int8 and NF4 do). Default: by ``quant_method``."""
        return quantization_config.get("quant_method") in cls.quant_methods

    def embedding_source(self) -> str | None:
        """The checkpoint prefix of a quantized linear whose weight's rows are the
        model's token embedding (a tied LM head kept quantized: the checkpoint stores no
        float table), or None (the default: the embedding is a float tensor)."""
        return None

    @abstractmethod
    def weight_formats(self) -> tuple[str, ...]:
        """The formats ``create_weight`` returns (checked against the backend before any
        weight is read)."""

    def is_complete(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return all(s in tensors for s in self.required_suffixes)

    @abstractmethod
    def create_weight(self, prefix: str, tensors: Mapping[str, torch.Tensor],
                      dtype: torch.dtype) -> QuantizedWeight | None:
        """The packed weight of linear ``prefix`` from its tensors (by suffix, as stored;
        ``dtype``: the model's dtype, whose numbers a float weight quantized at load is
        rounded to first), or None to load it as a float linear (then ``tensors`` must
        hold a float ``weight``). ValueError naming the tensor for a shape or dtype that
        does not fit."""

    def describe(self) -> str:
        return self.name


def select_quantizer(registry, quantization_config: Mapping[str, Any] | None, requested: str | None) -> BaseQuantizer | None:
    """The quantizer of a model load: the one that reads the checkpoint's
    ``quantization_config``, or the one named by ``requested`` (``--quantize``) for a
    float checkpoint; None for a float model without ``--quantize``. ValueError names
    what is wrong: an unknown or unbuilt name, a checkpoint format nothing reads, a
    request that contradicts the checkpoint."""
    if requested is not None and requested not in registry:
        if requested in NOT_BUILT:
            raise ValueError(f"--quantize {requested} is not supported: {NOT_BUILT[requested]}; "
                             f"registered quantizers: {', '.join(registry.names()) or 'none'}")
        raise ValueError(f"unknown quantizer {requested!r} (--quantize); registered: "
                         f"{', '.join(registry.names()) or 'none'}")
    if quantization_config:
        if not isinstance(quantization_config, Mapping):
            raise ValueError(f"quantization_config in config.json must be an object, got {quantization_config!r}")
        readers = [(name, cls) for name, cls in registry.items() if cls.accepts(quantization_config)]
        method = quantization_config.get("quant_method")
        if not readers:
            raise ValueError(f"the checkpoint is quantized with quant_method {method!r}, which no registered "
                             f"quantizer reads; registered: {', '.join(registry.names()) or 'none'}")
        if requested is not None and requested not in [name for name, _ in readers]:
            raise ValueError(f"--quantize {requested} does not match the checkpoint, which is quantized with "
                             f"{method!r} (read by {', '.join(n for n, _ in readers)}); drop --quantize")
        cls = readers[0][1] if requested is None else registry.get(requested)
        return cls(quantization_config)
    if requested is None:
        return None
    cls = registry.get(requested)
    if not cls.quantizes_float:
        raise ValueError(f"--quantize {requested} reads checkpoints already quantized that way, and this model "
                         "has no quantization_config; to quantize a float model at load use "
                         f"{', '.join(n for n, c in registry.items() if c.quantizes_float) or 'none'}")
    return cls(None)


def resolve_ops(quantizer: BaseQuantizer, backend, compute_dtype: torch.dtype,
                dequantize: bool) -> dict[str, QuantizedLinearOp | None]:
    """The backend's op for each format the quantizer makes (None: dequantized at load,
    allowed only with ``dequantize``); ValueError naming the format and backend otherwise."""
    ops: dict[str, QuantizedLinearOp | None] = {}
    for fmt in quantizer.weight_formats():
        op = backend.quantized_linear_op(fmt, compute_dtype)
        if op is None:
            if not dequantize:
                native = ", ".join(backend.quantized_formats(compute_dtype)) or "none"
                raise ValueError(
                    f"the {backend.name} backend does not run {fmt!r} weights (from quantizer {quantizer.name!r}) "
                    f"in {compute_dtype}; it runs: {native}. Pass --dequantize (EngineConfig.dequantize=True) to "
                    "load them as float weights instead"
                )
            logger.warning("%s weights (quantizer %s) are dequantized to %s at load: the %s backend has no kernel "
                           "for them (--dequantize)", fmt, quantizer.name, compute_dtype, backend.name)
        ops[fmt] = op
    return ops
