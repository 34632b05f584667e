"""``--quantize int8`` / ``int4``: weight-only quantization of a float checkpoint at load.

int8: per output channel, symmetric, ``scale = max|w| / 127`` (as bitsandbytes'
LLM.int8 rows and torchao's int8 weight-only). int4: groups of 64 input columns
(``int4-g32``, ``int4-g128`` for the others), asymmetric min/max over each group,
``w = q * scale + min`` with q in 0..15 (torchao's int4 weight-only grid). The
linears of the decoder layers are quantized; embeddings and the LM head stay float.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ember.plugin import hookimpl
from ember.plugin.quantized_weights import Int4Weight, Int8Weight, pack_nibbles
from ember.plugin.quantizer import BaseQuantizer


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide in_features {k}; choose a group size that "
                         "does (int4-g32, int4 (64), int4-g128)")
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
    return Int4Weight(pack_nibbles(q), scale, lo)


class _WeightOnly(BaseQuantizer):
    quantizes_float = True

    def __init__(self, quantization_config: Mapping | None = None) -> None:
        super().__init__(quantization_config)
        if quantization_config:
            raise ValueError(f"{self.name} quantizes float checkpoints at load; this one is already quantized "
                             f"({dict(quantization_config).get('quant_method')!r})")

    def create_weight(self, prefix, tensors, dtype):
        weight = tensors["weight"]
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"{prefix}.weight: expected a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
        if prefix == "lm_head":
            return None  # the logits' precision matters most; kept as the model's float
        return self.quantize(weight.to(dtype))


class Int8Quantizer(_WeightOnly):
    name = "int8"

    def weight_formats(self):
        return ("int8",)

    def quantize(self, weight):
        return quantize_int8(weight)


class Int4Quantizer(_WeightOnly):
    name = "int4"
    group_size = 64

    def weight_formats(self):
        return ("int4",)

    def quantize(self, weight):
        return quantize_int4(weight, self.group_size)

    def describe(self) -> str:
        return f"{self.name} (groups of {self.group_size})"


class Int4G32Quantizer(Int4Quantizer):
    name = "int4-g32"
    group_size = 32


class Int4G128Quantizer(Int4Quantizer):
    name = "int4-g128"
    group_size = 128


@hookimpl
def ember_register_quantizers(registry) -> None:
    for cls in (Int8Quantizer, Int4Quantizer, Int4G32Quantizer, Int4G128Quantizer):
        registry.register(cls.name, cls)
