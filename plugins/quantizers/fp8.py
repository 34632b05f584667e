"""FP8 checkpoints (``quant_method: "fp8"``, transformers' fine-grained FP8, and
``"fbgemm_fp8"``): ``weight`` float8_e4m3fn ``(N, K)`` with a scale per tensor, per
output channel (``weight_scale``) or per block (``weight_scale_inv`` of shape
``(N / bn, K / bk)`` for ``weight_block_size [bn, bk]``, a multiplier despite its
name): ``w = weight * scale``. ``input_scale`` (static activation scales) is unused:
Ember runs the weights only. The ``fp8_e4m3`` form runs where a backend has an FP8
kernel; elsewhere it is dequantized on request (``--dequantize``).
"""

from __future__ import annotations

from ember.plugin import hookimpl
from ember.plugin.quantized_weights import FP8Weight
from ember.plugin.quantizer import BaseQuantizer


class FP8Quantizer(BaseQuantizer):
    name = "fp8"
    quant_methods = ("fp8", "fbgemm_fp8")
    tensor_suffixes = ("weight", "weight_scale", "weight_scale_inv", "input_scale", "input_scale_ub")

    def __init__(self, quantization_config=None) -> None:
        super().__init__(quantization_config)
        fmt = self.quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 format {fmt!r} is not supported (e4m3 is)")

    def weight_formats(self):
        return ("fp8_e4m3",)

    def is_complete(self, tensors) -> bool:
        return "weight" in tensors and ("weight_scale" in tensors or "weight_scale_inv" in tensors)

    def create_weight(self, prefix, tensors, dtype):
        scale = tensors.get("weight_scale", tensors.get("weight_scale_inv"))
        if scale is None:
            return None  # a linear left in float (modules_to_not_convert)
        return FP8Weight(tensors["weight"], scale)


@hookimpl
def ember_register_quantizers(registry) -> None:
    registry.register(FP8Quantizer.name, FP8Quantizer)
