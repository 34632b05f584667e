"""flash-attn's two paged entry points as its documentation defines them, written in
PyTorch (float32 on CPU tensors) with the checks its kernels make on their arguments.

This is not flash-attn: its kernels need an NVIDIA or AMD GPU. It lets the tests check
Ember's adapter (ember.hardware.flash_attention) on this machine: that it hands
flash-attn what the API documents (the paged cache layout, int32 block tables and
sequence lengths, cumulative offsets, the bottom-right causal mask, pages of a
multiple of 256 tokens, float16/bfloat16 only, sliding windows as ``window_size=(left,
right)`` around the bottom-right diagonal, ``softcap * tanh(s / softcap)`` of the scaled
score ``s``), against the conformance kit's float64 reference. Whether flash-attn's
kernels compute what they document is for a
GPU to show (benchmarks/device_check.py)."""

from __future__ import annotations

import torch

__version__ = "reference"


def _check(q, k_cache, v_cache, block_table):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    for name, t in (("q", q), ("k", k_cache), ("v", v_cache)):
        if t.stride(-1) != 1:
            raise RuntimeError(f"Input tensor {name} must have contiguous last dimension")
    if block_table.dtype != torch.int32:
        raise RuntimeError("block_table must have dtype torch.int32")
    if block_table.stride(-1) != 1:
        raise RuntimeError("block_table must have contiguous last dimension")
    if k_cache.shape[1] % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if q.shape[-2] % k_cache.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _check_limits(window_size, softcap):
    left, right = window_size  # flash-attn unpacks the pair into two ints
    if not all(isinstance(x, int) and x >= -1 for x in (left, right)):
        raise RuntimeError(f"window_size must be two ints >= -1, got {window_size!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise RuntimeError(f"softcap must be a number >= 0, got {softcap!r}")


def _attend(q, k_cache, v_cache, table_row, seqlen_k, scale, causal, window_size=(-1, -1), softcap=0.0):
    """One sequence: q (seqlen_q, heads, d) over the first seqlen_k cached positions.
    Query i's diagonal is key ``i + seqlen_k - seqlen_q``; it sees keys from ``left``
    before it to ``right`` after it (-1: no limit; causal: right 0)."""
    page = k_cache.shape[1]
    positions = torch.arange(seqlen_k)
    slots_block = table_row.long()[positions // page]
    k = k_cache[slots_block, positions % page].float()  # (seqlen_k, heads_k, d)
    v = v_cache[slots_block, positions % page].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    diagonal = (seqlen_k - q.shape[0] + torch.arange(q.shape[0]))[:, None]  # aligned to the bottom right
    keys = torch.arange(seqlen_k)[None, :]
    allowed = torch.ones(q.shape[0], seqlen_k, dtype=torch.bool)
    if right >= 0:
        allowed &= keys <= diagonal + right
    if left >= 0:
        allowed &= keys >= diagonal - left
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    if block_table is None:
        raise NotImplementedError("this reference covers the paged form (block_table) only")
    _check(q, k, v, block_table)
    _check_limits(window_size, softcap)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    if max(lens_q) > max_seqlen_q or max(lens_k) > max_seqlen_k:
        raise RuntimeError("max_seqlen_q / max_seqlen_k below a sequence's length")
    start = 0
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        out[start : start + n_q] = _attend(q[start : start + n_q], k, v, block_table[b], n_k, scale, causal,
                                           window_size, softcap)
        start += n_q
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    if block_table is None or k is not None or cache_seqlens is None:
        raise NotImplementedError("this reference covers paged caches with cache_seqlens and no new k/v")
    if q.dim() != 4:
        raise RuntimeError("q must be (batch_size, seqlen, nheads, headdim)")
    _check(q, k_cache, v_cache, block_table)
    _check_limits(window_size, softcap)
    if cache_seqlens.dtype != torch.int32:
        raise RuntimeError("cache_seqlens must have dtype int32")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b, n_k in enumerate(cache_seqlens.tolist()):
        out[b] = _attend(q[b], k_cache, v_cache, block_table[b], n_k, scale, causal, window_size, softcap)
    return out
