"""GGUF (llama.cpp) quantization types: their block layouts and dequantization in torch.

Each `dequantize_*` takes the raw bytes of a tensor as a uint8 tensor whose last
dimension holds whole blocks (GGUF stores a 2-D weight as rows of blocks along its
input dimension) and returns float32 values of shape (..., blocks * block_size),
equal bit for bit to `gguf.quants.dequantize` on the same bytes: every float32
operation is the one the reference performs, in the same order (float16 scales
widened to float32 first; products and sums rounded as numpy rounds them).

Layouts (bytes per block), as ggml defines them:
    Q4_0 (18 / 32):  d f16, 16 bytes of nibbles (low nibbles elements 0..15, high 16..31); x = d (q - 8)
    Q4_1 (20 / 32):  d f16, m f16, 16 bytes of nibbles;                                     x = d q + m
    Q5_0 (22 / 32):  d f16, qh u32 (5th bits), 16 bytes of nibbles;                         x = d (q - 16)
    Q5_1 (24 / 32):  d f16, m f16, qh u32, 16 bytes of nibbles;                             x = d q + m
    Q8_0 (34 / 32):  d f16, 32 int8;                                                         x = d q
    Q2_K (84 / 256): 16 scale bytes (4-bit scale | 4-bit min), 64 bytes of 2-bit q, d, dmin
    Q3_K (110 / 256): 32 bytes high-bit mask, 64 bytes of 2-bit q, 12 bytes 6-bit scales, d
    Q4_K (144 / 256): d, dmin, 12 bytes of 6-bit scales and mins (8 of each), 128 bytes of nibbles;
                      sub-block j of 32: x = d sc_j q - dmin m_j
    Q5_K (176 / 256): as Q4_K plus 32 bytes of 5th bits before the nibbles
    Q6_K (210 / 256): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d;
                      sub-block of 16: x = d sc (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class GGUFQuantType:
    """One GGUF quantization type: ggml's type id, elements and bytes per block."""

    name: str
    type_id: int
    block_size: int
    type_size: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]

    def row_bytes(self, num_columns: int) -> int:
        """Bytes of one row of `num_columns` values; ValueError unless whole blocks."""
        if num_columns % self.block_size:
            raise ValueError(
                f"{self.name} stores rows in blocks of {self.block_size} values; "
                f"a row of {num_columns} is not a whole number of blocks"
            )
        return num_columns // self.block_size * self.type_size


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """float32 from little-endian float16 bytes (..., 2 k) -> (..., k)."""
    return raw.contiguous().view(torch.float16).float()


def _blocks(data: torch.Tensor, qtype_size: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    if data.dtype != torch.uint8:
        raise ValueError(f"GGUF quantized data must be uint8 bytes, got {data.dtype}")
    if data.dim() == 0 or data.shape[-1] % qtype_size:
        raise ValueError(f"last dimension of {tuple(data.shape)} bytes is not whole blocks of {qtype_size} bytes")
    lead = tuple(data.shape[:-1])
    return data.reshape(-1, qtype_size), lead


def _out(values: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    return values.reshape(*lead, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16 k) packed bytes -> (n, 32 k) as ggml's 32-blocks: low nibbles then high ones per 16 bytes."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 16)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, -1)


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count // 8) bytes -> (n, count) bits, byte by byte, least significant bit first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(raw.shape[0], count)


def dequantize_q4_0(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 18)
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _out(d * q.float(), lead)


def dequantize_q4_1(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 20)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).float()
    return _out(d * q + m, lead)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    # qh is a little-endian uint32 whose bit i is element i's 5th bit: byte-wise bits in order
    return _bits(qh, 32) << 4


def dequantize_q5_0(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 22)
    d = _f16(blocks[:, :2])
    q = (_nibbles(blocks[:, 6:]) | _q5_high(blocks[:, 2:6])).to(torch.int8) - 16
    return _out(d * q.float(), lead)


def q5_0_as_q8_0(data: torch.Tensor) -> torch.Tensor:
    """Q5_0 rows (..., blocks * 22 bytes) re-encoded as Q8_0 (..., blocks * 34 bytes) holding
    the same values bit for bit: each block's scale ``d`` kept, its 5-bit ``q - 16`` (in
    [-16, 15]) as an int8. Lossless, 34 / 22 of the bytes: the CPU backend runs Q8_0 in
    its 8-row (x8) kernels, which Q5_0 has not."""
    blocks, lead = _blocks(data, 22)
    q = (_nibbles(blocks[:, 6:]) | _q5_high(blocks[:, 2:6])).to(torch.int8) - 16
    return _out(torch.cat((blocks[:, :2], q.view(torch.uint8)), dim=1), lead)


def dequantize_q5_1(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 24)
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = (_nibbles(blocks[:, 8:]) | _q5_high(blocks[:, 4:8])).float()
    return _out(d * q + m, lead)


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 34)
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return _out(q * d, lead)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) -> (n, 8, 32): per 32 bytes, the low nibbles are one sub-block and the high ones the next."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, -1, 32)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (uint8, (n, 8) each)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def dequantize_q4_k(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 144)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, -1, 1)
    ml = (dmin * mn.float()).reshape(n, -1, 1)
    q = _k_nibbles(blocks[:, 16:]).float()
    return _out(dl * q - ml, lead)


def dequantize_q5_k(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 176)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, -1, 1)
    ml = (dmin * mn.float()).reshape(n, -1, 1)
    qh = blocks[:, 16:48]
    high = (qh.reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    q = (_k_nibbles(blocks[:, 48:]) | (high << 4)).float()
    return _out(dl * q - ml, lead)


def dequantize_q6_k(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 210)
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    low = ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, 8, 32)
    high = qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return _out(dl * q, lead)


def dequantize_q2_k(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 84)
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).float()
    return _out(dl * q - ml, lead)


def dequantize_q3_k(data: torch.Tensor) -> torch.Tensor:
    blocks, lead = _blocks(data, 110)
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    low = scales[:, :8].reshape(n, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 2, 1)
    high = scales[:, 8:].reshape(n, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 4, 1)
    sc = ((low.reshape(n, 16) & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1))
    ql = ql.reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1))
    qh = (qh.reshape(n, 16, 16) & 1) ^ 1  # the offset applies where the mask bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return _out(dl * q, lead)


QUANT_TYPES: dict[str, GGUFQuantType] = {
    t.name: t
    for t in (
        GGUFQuantType("Q4_0", 2, 32, 18, dequantize_q4_0),
        GGUFQuantType("Q4_1", 3, 32, 20, dequantize_q4_1),
        GGUFQuantType("Q5_0", 6, 32, 22, dequantize_q5_0),
        GGUFQuantType("Q5_1", 7, 32, 24, dequantize_q5_1),
        GGUFQuantType("Q8_0", 8, 32, 34, dequantize_q8_0),
        GGUFQuantType("Q2_K", 10, QK_K, 84, dequantize_q2_k),
        GGUFQuantType("Q3_K", 11, QK_K, 110, dequantize_q3_k),
        GGUFQuantType("Q4_K", 12, QK_K, 144, dequantize_q4_k),
        GGUFQuantType("Q5_K", 13, QK_K, 176, dequantize_q5_k),
        GGUFQuantType("Q6_K", 14, QK_K, 210, dequantize_q6_k),
    )
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def quant_type(name: str) -> GGUFQuantType:
    """The type named `name` (ggml's spelling, e.g. "Q4_1"); ValueError naming it and the supported ones."""
    found = QUANT_TYPES.get(str(name).upper())
    if found is None:
        raise ValueError(
            f"GGUF tensor type {name!r} is not supported quantized; supported: {', '.join(QUANT_TYPES)} "
            f"(and the float types {', '.join(FLOAT_TYPES)})"
        )
    return found


def dequantize(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 values of GGUF `type_name` bytes `data` (..., row bytes) -> (..., row values)."""
    return quant_type(type_name).dequantize(data)
