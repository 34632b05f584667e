"""bitsandbytes checkpoints saved by transformers (``quant_method: "bitsandbytes"``):

* int8 (``load_in_8bit``, TGI's ``bitsandbytes``): ``weight`` int8 ``(N, K)`` and ``SCB``
  float32 ``(N,)``, ``w = weight * SCB / 127`` (LLM.int8's row-wise absmax; the
  outlier threshold only matters to how bitsandbytes multiplies): an int8 grid.
* NF4 (``load_in_4bit`` with ``bnb_4bit_quant_type: "nf4"``, TGI's
  ``bitsandbytes-nf4``): ``weight`` uint8 (two codes a byte, the first in the high
  nibble), ``weight.absmax`` per block, ``weight.quant_map`` (the 16 NF4 values),
  ``weight.quant_state.bitsandbytes__nf4`` (JSON: blocksize, shape), and with nested
  statistics ``weight.nested_absmax`` / ``weight.nested_quant_map`` (absmax stored as
  8-bit codes of its own, plus ``nested_offset``): the ``nf4`` form, which backends
  without a lookup-table kernel dequantize on request (``--dequantize``).
"""

from __future__ import annotations

import json

import torch

from ember.plugin import hookimpl
from ember.plugin.quantized_weights import Int8Weight, NF4Weight
from ember.plugin.quantizer import BaseQuantizer
from ember.plugins.quantizers.weight_only import quantize_int8

NF4_STATE = "weight.quant_state.bitsandbytes__nf4"


class BitsAndBytesInt8Quantizer(BaseQuantizer):
    name = "bitsandbytes"
    quant_methods = ("bitsandbytes",)
    tensor_suffixes = ("weight", "SCB", "weight_format")
    # transformers writes weight_format after weight; a checkpoint without it completes
    # at the end of the file
    required_suffixes = ("weight", "SCB", "weight_format")

    # on a float checkpoint (TGI's --quantize bitsandbytes): LLM.int8's row-wise absmax
    # int8, without its outlier decomposition (which is about how bitsandbytes multiplies)
    quantizes_float = True

    @classmethod
    def accepts(cls, quantization_config) -> bool:
        return quantization_config.get("quant_method") == "bitsandbytes" and bool(
            quantization_config.get("load_in_8bit"))

    def weight_formats(self):
        return ("int8",)

    def is_complete(self, tensors) -> bool:
        return super().is_complete(tensors) if self.quantization_config else "weight" in tensors

    def create_weight(self, prefix, tensors, dtype):
        if not self.quantization_config:
            return None if prefix == "lm_head" else quantize_int8(tensors["weight"].to(dtype))
        if "SCB" not in tensors:
            return None  # a skipped module (llm_int8_skip_modules), stored in float
        weight, scb = tensors["weight"], tensors["SCB"]
        if weight.dtype != torch.int8 or scb.shape != (weight.shape[0],):
            raise ValueError(f"{prefix}: bitsandbytes int8 needs an int8 weight and SCB of one value per row; got "
                             f"{weight.dtype} {tuple(weight.shape)} and SCB {tuple(scb.shape)}")
        fmt = tensors.get("weight_format")
        if fmt is not None and fmt.numel() == 1 and int(fmt.item()) != 0:
            raise ValueError(f"{prefix}.weight_format {int(fmt.item())} is not the row-major layout (0)")
        return Int8Weight(weight, (scb.float() / 127)[:, None])


class BitsAndBytesNF4Quantizer(BaseQuantizer):
    name = "bitsandbytes-nf4"
    quant_methods = ("bitsandbytes",)
    tensor_suffixes = ("weight", "weight.absmax", "weight.quant_map", NF4_STATE, "weight.nested_absmax",
                       "weight.nested_quant_map")
    required_suffixes = ("weight", "weight.absmax", "weight.quant_map", NF4_STATE)

    def __init__(self, quantization_config=None) -> None:
        super().__init__(quantization_config)
        kind = self.quantization_config.get("bnb_4bit_quant_type", "nf4")
        if kind != "nf4":
            raise ValueError(f"bitsandbytes 4-bit {kind!r} is not supported (nf4 is)")

    @classmethod
    def accepts(cls, quantization_config) -> bool:
        return quantization_config.get("quant_method") == "bitsandbytes" and bool(
            quantization_config.get("load_in_4bit"))

    def weight_formats(self):
        return ("nf4",)

    def is_complete(self, tensors) -> bool:
        if not super().is_complete(tensors):
            return False
        state = json.loads(bytes(tensors[NF4_STATE].tolist()))
        nested = "nested_blocksize" in state
        return not nested or {"weight.nested_absmax", "weight.nested_quant_map"} <= set(tensors)

    def create_weight(self, prefix, tensors, dtype):
        if NF4_STATE not in tensors:
            return None
        state = json.loads(bytes(tensors[NF4_STATE].tolist()))
        if state.get("quant_type") != "nf4":
            raise ValueError(f"{prefix}: quant_state says {state.get('quant_type')!r}, expected 'nf4'")
        shape = tuple(state["shape"])
        absmax = tensors["weight.absmax"]
        if "nested_blocksize" in state:
            # absmax itself quantized blockwise to 8-bit codes: code[absmax] * nested_absmax + offset
            code = tensors["weight.nested_quant_map"].float()
            nested = tensors["weight.nested_absmax"].float()
            values = code[absmax.long()] * nested.repeat_interleave(state["nested_blocksize"])[: absmax.numel()]
            absmax = values + float(state["nested_offset"])
        return NF4Weight(shape, tensors["weight"], absmax.float(), tensors["weight.quant_map"], state["blocksize"])


@hookimpl
def ember_register_quantizers(registry) -> None:
    registry.register(BitsAndBytesInt8Quantizer.name, BitsAndBytesInt8Quantizer)
    registry.register(BitsAndBytesNF4Quantizer.name, BitsAndBytesNF4Quantizer)
