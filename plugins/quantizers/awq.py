"""AWQ checkpoints in the GEMM layout (AutoAWQ, ``version: "gemm"``): per linear
``qweight`` int32 ``(K, N / 8)`` and ``qzeros`` int32 ``(groups, N / 8)``, both packed
along the output dimension with AutoAWQ's interleaved nibble order, and ``scales``
``(groups, N)``: ``w[n, k] = (q[k, n] - z[k // group, n]) * scales[k // group, n]``.
Runs as an int4 grid. GEMV-layout checkpoints are refused by name.
"""

from __future__ import annotations

import torch

from ember.plugin import hookimpl
from ember.plugin.quantizer import BaseQuantizer
from ember.plugins.quantizers.packing import AWQ_ORDER, grid_weight, unpack_int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``(rows, N / 8)`` int32 in AWQ's order -> ``(rows, N)`` values 0..15."""
    values = unpack_int32(packed, 4, 1)  # nibble order within each word
    rows, n = values.shape
    # nibble i of a word holds logical column AWQ_ORDER[i] of its group of 8
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
    return values.view(rows, n // 8, 8)[:, :, inverse].reshape(rows, n)


class AWQQuantizer(BaseQuantizer):
    name = "awq"
    quant_methods = ("awq",)
    tensor_suffixes = ("qweight", "qzeros", "scales")
    required_suffixes = ("qweight", "qzeros", "scales")

    def __init__(self, quantization_config=None) -> None:
        super().__init__(quantization_config)
        cfg = self.quantization_config
        bits = cfg.get("bits", cfg.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits!r} is not supported (4 is)")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: only the GEMM layout ('gemm') is read")
        if cfg.get("zero_point", True) is False:
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        self.group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))

    def weight_formats(self):
        return ("int4",)

    def create_weight(self, prefix, tensors, dtype):
        if "qweight" not in tensors:
            return None
        q = unpack_awq(tensors["qweight"])  # (K, N)
        k, n = q.shape
        scales = tensors["scales"]
        group_size = k if self.group_size == -1 else self.group_size
        if k % group_size or scales.shape != (k // group_size, n):
            raise ValueError(f"{prefix}.scales has shape {tuple(scales.shape)}, expected ({k // group_size}, {n})")
        zeros = unpack_awq(tensors["qzeros"])
        if zeros.shape != scales.shape:
            raise ValueError(f"{prefix}.qzeros unpacks to {tuple(zeros.shape)}, expected {tuple(scales.shape)}")
        return grid_weight(q.t(), zeros.t(), scales.t(), 4)

    def describe(self) -> str:
        return f"awq (gemm, groups of {self.group_size})"


@hookimpl
def ember_register_quantizers(registry) -> None:
    registry.register(AWQQuantizer.name, AWQQuantizer)
