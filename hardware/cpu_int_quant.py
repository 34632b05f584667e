"""The CPU backend's ops for the integer grids of ``ember.plugin.quantized_weights``: PyTorch's
weight-only kernels ``_weight_int8pack_mm`` (int8, per channel) and
``_weight_int4pack_mm_for_cpu`` (int4, per group, ``w = (q - 8) * scale + zero``).

Both kernels take bfloat16 activations: with float32 ones they fell to a scalar path,
20-30x slower than bf16 on an AVX2 EPYC (1 row x 576 x 3072: int4 6.4 ms fp32 against
0.28 ms bf16, int8 3.4 against 0.17 ms). So activations are rounded to bf16 for the
product (scales too), and the output is returned in the compute dtype; the tolerance
this costs is stated in docs/quantization.md.
"""

from __future__ import annotations

import torch

from ember.plugin.quantized_weights import Int4Weight, Int8Weight, unpack_nibbles
from ember.plugin.quantizer import QuantizedLinearOp, QuantizedWeight

ACT_DTYPE = torch.bfloat16
_INT8_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
INNER_K_TILES = 2
ALIGN = 64


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when its data does not start on a 64-byte boundary.

    ``_weight_int8pack_mm`` (PyTorch 2.13, AVX-512 path) reads its activations and
    weight with aligned vector loads: an operand at an address that is not a multiple
    of 64 bytes (a small tensor in a safetensors file's mapping, a view into a larger
    buffer) crashes the process with SIGSEGV. PyTorch's CPU allocator aligns to 64
    bytes, so a copy is aligned."""
    return t if t.data_ptr() % ALIGN == 0 else t.clone(memory_format=torch.contiguous_format)


def int8_available() -> bool:
    return _INT8_MM is not None


def int4_available() -> bool:
    return _INT4_MM is not None and _INT4_PACK is not None


def _flat(x: torch.Tensor, weight) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)
    return aligned(x.to(ACT_DTYPE).contiguous())


def _unpermute(stored: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    if perm is None:
        return stored
    out = torch.empty_like(stored)
    out[:, perm] = stored
    return out


class CPUInt8Weight(QuantizedWeight):
    """The kernel's form of an :class:`Int8Weight`: int8 ``blocks`` (one per group,
    contiguous), ``scales`` ``(groups, N)`` and offsets in bf16. ``dequantize`` gives the
    numbers the kernel multiplies by."""

    format = "int8"

    def __init__(self, weight: Int8Weight) -> None:
        super().__init__(weight.shape)
        groups = weight.scales.shape[1]
        q = weight.qweight
        blocks = [q] if groups == 1 else q.view(q.shape[0], groups, -1).unbind(1)
        self.blocks = [aligned(b.contiguous()) for b in blocks]
        self.scales = aligned(weight.scales.t().to(ACT_DTYPE).contiguous())
        self.offsets = weight.offsets.t().to(ACT_DTYPE).contiguous() if weight.offsets is not None else None
        self.perm = weight.perm

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"block{i}": b for i, b in enumerate(self.blocks)}
        out["scales"] = self.scales
        if self.offsets is not None:
            out["offsets"] = self.offsets
        if self.perm is not None:
            out["perm"] = self.perm
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = torch.cat([b.float() for b in self.blocks], dim=1)
        g = self.shape[1] // self.scales.shape[0]
        w = q * self.scales.float().t().repeat_interleave(g, 1)
        if self.offsets is not None:
            w += self.offsets.float().t().repeat_interleave(g, 1)
        return _unpermute(w, self.perm).to(dtype)


class Int8LinearOp(QuantizedLinearOp):
    format = "int8"
    max_relative_error = 2**-7  # bf16 activations and output

    def prepare(self, weight: Int8Weight) -> CPUInt8Weight:
        return CPUInt8Weight(weight)

    def __call__(self, x, weight: CPUInt8Weight, bias=None):
        shape, dtype = x.shape, x.dtype
        xa = _flat(x, weight)
        blocks = weight.blocks
        if len(blocks) == 1:
            y = _INT8_MM(xa, blocks[0], weight.scales[0])
        else:
            xs = xa.view(xa.shape[0], len(blocks), -1)
            y = _INT8_MM(xs[:, 0].contiguous(), blocks[0], weight.scales[0]).float()
            for g in range(1, len(blocks)):
                y += _INT8_MM(xs[:, g].contiguous(), blocks[g], weight.scales[g])
        if weight.offsets is not None:
            # sum_k x_k * offset_g(k): per-group sums of x against the offsets
            sums = xa.float().view(xa.shape[0], weight.offsets.shape[0], -1).sum(-1)
            y = y.float() + sums @ weight.offsets.float()
        y = y.to(dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        return y.view(*shape[:-1], -1)


class CPUInt4Weight(QuantizedWeight):
    """The kernel's form of an :class:`Int4Weight`: ``packed`` (its opaque int4 layout)
    and ``scale_zeros`` ``(groups, N, 2)`` bf16 with ``zero = offset + 8 * scale``.
    ``dequantize`` gives the numbers the kernel multiplies by."""

    format = "int4"

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__(weight.shape)
        q = unpack_nibbles(weight.qweight).to(torch.int32)
        self.packed = _INT4_PACK(q.contiguous(), INNER_K_TILES)
        zeros = weight.offsets + 8 * weight.scales
        self.scale_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(ACT_DTYPE).contiguous()
        self.group_size = weight.group_size
        self.perm = weight.perm

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"packed": self.packed, "scale_zeros": self.scale_zeros}
        if self.perm is not None:
            out["perm"] = self.perm
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = self.shape[1]
        # the kernel against the identity with scale 1 and zero 0 gives q - 8 exactly
        unit = torch.zeros_like(self.scale_zeros)
        unit[..., 0] = 1
        q = _INT4_MM(torch.eye(k, dtype=ACT_DTYPE), self.packed, self.group_size, unit).float().t()
        s = self.scale_zeros[..., 0].float().t().repeat_interleave(self.group_size, 1)
        z = self.scale_zeros[..., 1].float().t().repeat_interleave(self.group_size, 1)
        return _unpermute(q * s + z, self.perm).to(dtype)


class Int4LinearOp(QuantizedLinearOp):
    format = "int4"
    max_relative_error = 2**-7  # bf16 activations and output

    def prepare(self, weight: Int4Weight) -> CPUInt4Weight:
        n, k = weight.shape
        if k % 16 or n % 16:
            raise ValueError(f"the cpu int4 kernel needs in_features and out_features divisible by 16, "
                             f"got a weight of shape {weight.shape}")
        return CPUInt4Weight(weight)

    def __call__(self, x, weight: CPUInt4Weight, bias=None):
        shape, dtype = x.shape, x.dtype
        y = _INT4_MM(_flat(x, weight), weight.packed, weight.group_size, weight.scale_zeros).to(dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        return y.view(*shape[:-1], -1)


def linear_ops() -> dict[str, type[QuantizedLinearOp]]:
    """The formats this module runs on this build of PyTorch, by format."""
    ops: dict[str, type[QuantizedLinearOp]] = {}
    if int8_available():
        ops["int8"] = Int8LinearOp
    if int4_available():
        ops["int4"] = Int4LinearOp
    return ops
