"""compressed-tensors checkpoints (llm-compressor, ``quant_method: "compressed-tensors"``),
weight-only schemes:

* ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 ``(N, K * bits / 32)``,
  signed values offset by ``2 ** (bits - 1)`` and packed along the input dimension;
  ``weight_scale`` ``(N, groups)`` (``(N, 1)`` per channel); for asymmetric schemes
  ``weight_zero_point`` packed the same way along the output dimension; ``weight_g_idx``
  for act-order groups; ``weight_shape``. ``w = (q - zero) * scale``: int4 / int8 grids.
* ``int-quantized`` (8-bit): ``weight`` int8 and ``weight_scale``: an int8 grid.
* ``float-quantized`` (FP8): ``weight`` float8_e4m3fn and ``weight_scale`` per tensor or
  channel: the ``fp8_e4m3`` form, which backends without an FP8 kernel dequantize on
  request (``--dequantize``).

A config group that quantizes input activations (W8A8 and the like) is refused: the
activations would have to be quantized as the checkpoint was calibrated for.
"""

from __future__ import annotations

import torch

from ember.plugin import hookimpl
from ember.plugin.quantized_weights import FP8Weight
from ember.plugin.quantizer import BaseQuantizer
from ember.plugins.quantizers.packing import grid_weight, group_order, unpack_int32

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


class CompressedTensorsQuantizer(BaseQuantizer):
    name = "compressed-tensors"
    quant_methods = ("compressed-tensors",)
    tensor_suffixes = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                       "weight_shape", "input_scale")
    required_suffixes = ("weight_scale",)

    def __init__(self, quantization_config=None) -> None:
        super().__init__(quantization_config)
        cfg = self.quantization_config
        self.format = cfg.get("format")
        if self.format not in FORMATS:
            raise ValueError(f"compressed-tensors format {self.format!r} is not supported ({', '.join(FORMATS)} are)")
        groups = cfg.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (one is)")
        group = next(iter(groups.values()))
        if group.get("input_activations"):
            raise ValueError("compressed-tensors with quantized input activations is not supported: Ember runs "
                             "weight-only schemes (W4A16, W8A16, FP8 weights)")
        w = group.get("weights") or {}
        self.bits, self.type = w.get("num_bits"), w.get("type", "int")
        self.symmetric = bool(w.get("symmetric", True))
        self.strategy = w.get("strategy")
        self.group_size = w.get("group_size")
        if self.type == "int" and self.bits not in (4, 8):
            raise ValueError(f"compressed-tensors int weights of {self.bits!r} bits are not supported (4 and 8 are)")
        if self.type == "float" and self.bits != 8:
            raise ValueError(f"compressed-tensors float weights of {self.bits!r} bits are not supported (fp8 is)")
        if self.strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"compressed-tensors weight strategy {self.strategy!r} is not supported "
                             "(tensor, channel and group are)")
        self.ignore = list(cfg.get("ignore") or [])

    def weight_formats(self):
        if self.type == "float":
            return ("fp8_e4m3",)
        return ("int4",) if self.bits == 4 else ("int8",)

    def is_complete(self, tensors) -> bool:
        if "weight_scale" not in tensors:
            return False
        if self.format == "pack-quantized":
            need = {"weight_packed", "weight_shape"} | (set() if self.symmetric else {"weight_zero_point"})
        else:
            need = {"weight"}
        if self.strategy == "group" and self.format == "pack-quantized" and self._actorder():
            need.add("weight_g_idx")
        return need <= set(tensors)

    def _actorder(self) -> bool:
        group = next(iter(self.quantization_config["config_groups"].values()))
        return bool(group["weights"].get("actorder"))

    def create_weight(self, prefix, tensors, dtype):
        if "weight_scale" not in tensors:
            return None  # an ignored linear (lm_head and the like), stored in float
        scale = tensors["weight_scale"].float()
        if self.type == "float":
            return FP8Weight(tensors["weight"], scale)
        if self.format == "pack-quantized":
            n, k = (int(v) for v in tensors["weight_shape"].tolist())
            q = unpack_int32(tensors["weight_packed"], self.bits, 1)[:, :k]
            if q.shape != (n, k):
                raise ValueError(f"{prefix}.weight_packed unpacks to {tuple(q.shape)}, weight_shape says ({n}, {k})")
        else:
            q = tensors["weight"].to(torch.int32) + (1 << (self.bits - 1))
            n, k = q.shape
        if scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(n, 1)
        if scale.dim() == 1:
            scale = scale[:, None]
        if scale.shape[0] != n or k % scale.shape[1]:
            raise ValueError(f"{prefix}.weight_scale has shape {tuple(scale.shape)}, which does not fit a ({n}, {k}) "
                             "weight")
        offset = 1 << (self.bits - 1)
        zeros = torch.zeros_like(scale)
        if "weight_zero_point" in tensors:
            zp = tensors["weight_zero_point"]
            if self.format == "pack-quantized" and zp.dtype == torch.int32:
                zp = unpack_int32(zp, self.bits, 0)[:n] - offset
            zeros = zp.float().reshape(scale.shape)
        perm = None
        if "weight_g_idx" in tensors:
            perm = group_order(tensors["weight_g_idx"], k // scale.shape[1], f"{prefix}.weight_g_idx")
            if perm is not None:
                q = q[:, perm]
        # the stored unsigned value is q + offset: w = (q_u - offset - zero) * scale
        return grid_weight(q, zeros + offset, scale, self.bits, perm)

    def describe(self) -> str:
        return f"compressed-tensors ({self.format}, {self.type}{self.bits}, {self.strategy})"


@hookimpl
def ember_register_quantizers(registry) -> None:
    registry.register(CompressedTensorsQuantizer.name, CompressedTensorsQuantizer)
