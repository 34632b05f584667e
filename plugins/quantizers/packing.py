"""Unpacking the int32 words GPTQ, AWQ and compressed-tensors store their integers in,
and building the portable grids of ``ember.plugin.quantized_weights`` from them."""

from __future__ import annotations

import torch

from ember.plugin.quantized_weights import Int4Weight, Int8Weight, pack_nibbles

# AWQ's GEMM kernels interleave the 8 nibbles of a word: logical column j of a group of 8
# sits in nibble AWQ_ORDER.index(j) (AutoAWQ's AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed little-end-first into int32 words along ``dim``
    (the value at index ``i`` of ``dim`` is bits ``bits * (i % (32 / bits))`` of word
    ``i // (32 / bits)``) -> int32 values, ``dim`` grown ``32 / bits`` times."""
    if packed.dtype != torch.int32:
        raise ValueError(f"expected int32 packed words, got {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    p = packed.movedim(dim, -1)
    values = (p[..., None] >> shifts) & mask  # (..., words, per_word)
    values = values.reshape(*p.shape[:-1], p.shape[-1] * per_word)
    return values.movedim(-1, dim)


def group_order(g_idx: torch.Tensor, group_size: int, what: str) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous (stable sort of ``g_idx``);
    None when ``g_idx`` is the plain ``k // group_size``. ValueError unless every group
    has ``group_size`` columns."""
    g_idx = g_idx.long()
    k = g_idx.numel()
    if torch.equal(g_idx, torch.arange(k) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=k // group_size)
    if counts.numel() != k // group_size or not bool((counts == group_size).all()):
        raise ValueError(f"{what}: g_idx does not put {group_size} columns in each of {k // group_size} groups")
    return torch.sort(g_idx, stable=True).indices


def grid_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int,
                perm: torch.Tensor | None = None) -> Int4Weight | Int8Weight:
    """``w = (q - zero) * scale`` with unsigned ``q`` ``(N, K)`` in stored column order,
    ``zeros`` and ``scales`` ``(N, groups)``, as an int4 or int8 grid."""
    scales = scales.float()
    offsets = -zeros.float() * scales
    if bits == 4:
        return Int4Weight(pack_nibbles(q), scales, offsets, perm)
    if bits == 8:
        # unsigned 0..255 re-centred into int8: (q - 128) * s + (128 - z) * s
        return Int8Weight((q - 128).to(torch.int8), scales, offsets + 128 * scales, perm)
    raise ValueError(f"{bits}-bit weights are not supported (4 and 8 are)")
