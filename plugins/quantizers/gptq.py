"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum): per linear ``qweight`` int32
``(K * bits / 32, N)`` packed along the input dimension, ``qzeros`` int32
``(groups, N * bits / 32)`` packed along the output dimension, ``scales``
``(groups, N)`` and ``g_idx`` ``(K,)`` (each input column's group; act-order
checkpoints permute it). ``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with
``g = g_idx[k]``, where ``z`` is the stored zero plus one in the original
``checkpoint_format`` "gptq" (AutoGPTQ's quirk) and as stored in "gptq_v2".
4 and 8 bits run as int4 / int8 grids; act-order as a column order of the input.
"""

from __future__ import annotations

from ember.plugin import hookimpl
from ember.plugin.quantizer import BaseQuantizer
from ember.plugins.quantizers.packing import grid_weight, group_order, unpack_int32

FORMATS = ("gptq", "gptq_v2")


class GPTQQuantizer(BaseQuantizer):
    name = "gptq"
    quant_methods = ("gptq",)
    tensor_suffixes = ("qweight", "qzeros", "scales", "g_idx")
    required_suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, quantization_config=None) -> None:
        super().__init__(quantization_config)
        cfg = self.quantization_config
        self.bits = cfg.get("bits")
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ with bits={self.bits!r} is not supported (4 and 8 are)")
        self.group_size = int(cfg.get("group_size", 128))
        self.checkpoint_format = cfg.get("checkpoint_format") or "gptq"
        if self.checkpoint_format not in FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {self.checkpoint_format!r} is not supported "
                             f"({', '.join(FORMATS)} are)")

    def weight_formats(self):
        return ("int4",) if self.bits == 4 else ("int8",)

    def create_weight(self, prefix, tensors, dtype):
        if "qweight" not in tensors:
            return None  # a linear the checkpoint keeps in float
        for suffix in ("qzeros", "scales"):
            if suffix not in tensors:
                raise ValueError(f"GPTQ linear {prefix!r} has a qweight but no {suffix}")
        q = unpack_int32(tensors["qweight"], self.bits, 0)  # (K, N)
        k, n = q.shape
        scales = tensors["scales"]
        groups = scales.shape[0]
        group_size = k if self.group_size == -1 else self.group_size
        if scales.shape != (k // group_size, n) or k % group_size:
            raise ValueError(f"{prefix}.scales has shape {tuple(scales.shape)}, expected ({k // group_size}, {n}) for "
                             f"{k} inputs in groups of {group_size}")
        zeros = unpack_int32(tensors["qzeros"], self.bits, 1)[:, :n]
        if zeros.shape != (groups, n):
            raise ValueError(f"{prefix}.qzeros unpacks to {tuple(zeros.shape)}, expected ({groups}, {n})")
        if self.checkpoint_format == "gptq":
            zeros = zeros + 1
        perm = None
        if "g_idx" in tensors:
            g_idx = tensors["g_idx"]
            if g_idx.shape != (k,):
                raise ValueError(f"{prefix}.g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
            perm = group_order(g_idx, group_size, f"{prefix}.g_idx")
        q = q.t()
        if perm is not None:
            q = q[:, perm]
        return grid_weight(q, zeros.t(), scales.t(), self.bits, perm)

    def describe(self) -> str:
        return f"gptq ({self.bits}-bit, groups of {self.group_size}, {self.checkpoint_format})"


@hookimpl
def ember_register_quantizers(registry) -> None:
    registry.register(GPTQQuantizer.name, GPTQQuantizer)
