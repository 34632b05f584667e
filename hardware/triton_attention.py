"""Paged attention and KV-cache writes in Triton: one source for the GPU backends
(NVIDIA, AMD and Intel GPUs all run Triton), tested on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported).

``TritonAttention`` implements ``ember.plugin.backend.BaseAttention`` for any step: prompts,
chunks of prompts after a cached context, decodes, and all of them mixed in one flat
batch. Two kernels:

- ``_write_kv``: each of the step's tokens writes its K and V row (all KV heads) into
  the paged cache at its slot (``slot_mapping``); a negative slot (a padded token) is
  skipped.
- ``_paged_attention`` (decodes): one program per (query token, query head). It
  walks the token's context, ``BLOCK_N`` positions at a time, through its request's
  block table, reading K and V where they lie in the cache, and keeps an online
  softmax (running maximum and sum, FlashAttention's recurrence) in float32.
- ``_paged_attention_tiled`` (prompts and prompt chunks): the same walk for a tile of
  ``BLOCK_M`` consecutive query tokens of one request, the scores and the output as
  ``tl.dot`` products, so each key is read once per tile instead of once per token.

A token at position ``p`` sees positions ``0 .. p`` of its request: causal within a
prompt chunk, the whole cached context before it. GQA: query head ``h`` reads KV
head ``h // (num_heads // num_kv_heads)``. float32 products run at IEEE precision
(no TF32), so float32 results match the CPU backend's.

Sliding windows and logit soft-capping (``forward``'s ``window`` / ``softcap``) are
compile-time constants of both kernels (``WINDOW``, ``SOFTCAP``; 0 for none), so the
plain kernels compile exactly as before and each (window, cap) a model uses is one more
specialization. With a window, a walk starts at the first key the window reaches
(``p - window + 1``; for a tile, that of its first token), so blocks wholly before it are
never read, and keys at ``j <= p - window`` are masked; with a cap, each scaled score
``s`` becomes ``softcap * tanh(s / softcap)`` before the mask.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ember.plugin.backend import AttentionBatch, BaseAttention


@triton.jit
def _write_kv(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k, stride_v,  # elements between consecutive tokens of k and v (rows of a fused qkv)
    ROW: tl.constexpr,  # num_kv_heads * head_dim: one token's row in the cache
    BLOCK_ROW: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_ROW)
        mask = offs < ROW
        k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _context_rows(block_table_ptr, request, stride_table, n, n_mask, kv_head,
                  BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Cache offsets (elements) of KV head ``kv_head`` at context positions ``n`` of
    ``request``, through its block table row."""
    block = tl.load(block_table_ptr + request * stride_table + n // BLOCK_SIZE, mask=n_mask, other=0)
    return (block * BLOCK_SIZE + n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM


@triton.jit
def _soft_cap(scores, SOFTCAP: tl.constexpr):
    """``SOFTCAP * tanh(scores / SOFTCAP)``; tanh from one exp of ``-2|x|`` (Triton has no
    portable tanh), which saturates to +-1 where ``exp(2x)`` would overflow."""
    x = scores / SOFTCAP
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return SOFTCAP * tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, token_index_ptr, token_request_ptr,
    token_position_ptr, stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_table,
    scale,
    GROUP: tl.constexpr,  # query heads per KV head
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # context positions per iteration
    WINDOW: tl.constexpr,  # sliding window in positions; 0: the whole context
    SOFTCAP: tl.constexpr,  # logit soft-cap; 0.0: none
):
    token = tl.load(token_index_ptr + tl.program_id(0))  # a decode's flat row
    head = tl.program_id(1)
    kv_head = head // GROUP
    request = tl.load(token_request_ptr + token)
    position = tl.load(token_position_ptr + token)  # sees positions 0 .. position
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_q_token + head * stride_q_head + d, mask=d_mask, other=0.0).to(tl.float32)

    m_i = tl.full((1,), float("-inf"), tl.float32)  # running maximum of the scores
    l_i = tl.zeros((1,), tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    first_key = 0
    if WINDOW > 0:  # the walk starts at the window's first key: nothing before it is read
        first_key = tl.maximum(position - WINDOW + 1, 0)
    for start in range(first_key, position + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n <= position
        rows = _context_rows(block_table_ptr, request, stride_table, n, n_mask, kv_head,
                             BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if SOFTCAP > 0:
            scores = _soft_cap(scores, SOFTCAP)
        scores = tl.where(n_mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + token * stride_o_token + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@triton.jit
def _paged_attention_tiled(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
    tile_request_ptr, tile_token_ptr, tile_rows_ptr, tile_position_ptr,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_table,
    scale,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per tile (consecutive tokens of one request)
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" keeps float32 exact
    UPCAST: tl.constexpr,  # products in float32 (Triton's interpreter has no bf16/fp16 tl.dot)
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    request = tl.load(tile_request_ptr + tile)
    first = tl.load(tile_token_ptr + tile)  # flat row of the tile's first token
    num_rows = tl.load(tile_rows_ptr + tile)
    first_position = tl.load(tile_position_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    m_mask = m < num_rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (first + m)[:, None] * stride_q_token + head * stride_q_head + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    positions = first_position + m
    last = first_position + num_rows - 1

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    first_key = 0
    if WINDOW > 0:  # the first key the window of the tile's first token reaches
        first_key = tl.maximum(first_position - WINDOW + 1, 0)
    for start in range(first_key, last + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n <= last
        rows = _context_rows(block_table_ptr, request, stride_table, n, n_mask, kv_head,
                             BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP > 0:
            scores = _soft_cap(scores, SOFTCAP)
        visible = (n[None, :] <= positions[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > positions[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_ref = m_new
        if WINDOW > 0:  # a later row's window may not reach this block yet: exp(-inf - -inf) would be NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if WINDOW > 0:  # padding rows past the tile's last token may see no key at all (never stored)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (first + m)[:, None] * stride_o_token + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    block_table: torch.Tensor  # (num_requests, max_blocks) int64
    token_request: torch.Tensor  # (num_tokens,) int32: the request of each flat token
    token_position: torch.Tensor  # (num_tokens,) int64: its position in its request
    decode_tokens: torch.Tensor  # flat rows of the decodes (one query token each)
    # tiles of BLOCK_M consecutive query tokens of one request, over the prompts
    tile_request: torch.Tensor  # (num_tiles,) int32
    tile_token: torch.Tensor  # (num_tiles,) int64 flat row of its first token
    tile_rows: torch.Tensor  # (num_tiles,) int32 tokens in it
    tile_position: torch.Tensor  # (num_tiles,) int64 position of its first token


def kernel_limits(window: int | None, softcap: float | None) -> dict:
    """The kernels' ``WINDOW`` / ``SOFTCAP`` constants for forward's ``window`` / ``softcap``
    (0 for none); ValueError naming a window under 1 or a cap that is not positive."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of positions, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")
    return {"WINDOW": window or 0, "SOFTCAP": float(softcap or 0.0)}


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V rows ``(num_tokens, num_kv_heads, head_dim)`` into
    the paged ``kv_cache`` at its slot; tokens with a negative slot are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if k.stride(2) != 1 or k.stride(1) != head_dim or v.stride(2) != 1 or v.stride(1) != head_dim:
        k, v = k.contiguous(), v.contiguous()
    row = num_kv_heads * head_dim
    _write_kv[(k.shape[0],)](
        k, v, kv_cache[0], kv_cache[1], slot_mapping, k.stride(0), v.stride(0),
        ROW=row, BLOCK_ROW=triton.next_power_of_2(row),
    )


class TritonAttention(BaseAttention):
    """``BaseAttention`` over Triton kernels, for any device Triton runs on (and CPU
    tensors under ``TRITON_INTERPRET=1``). Decodes take one program per (token, head);
    prompts and prompt chunks take one per (tile of ``block_m`` tokens, head), whose
    keys are read once for the tile. ``block_n``: context positions per iteration.
    ``forward``'s ``window`` / ``softcap`` become the kernels' compile-time ``WINDOW`` /
    ``SOFTCAP`` (`kernel_limits`)."""

    name = "triton"

    def __init__(self, block_n: int = 32, block_m: int = 16) -> None:
        if block_n < 16 or block_m < 16:
            raise ValueError(f"block_n and block_m must be >= 16 (tl.dot's smallest tile), got {block_n}, {block_m}")
        self.block_n = block_n
        self.block_m = block_m

    def prepare(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        device = batch.device
        lens = torch.tensor(batch.query_lens, dtype=torch.int64, device=device)
        starts = torch.tensor(batch.start_positions, dtype=torch.int64, device=device)
        token_request = torch.repeat_interleave(torch.arange(len(batch.query_lens), device=device), lens)
        # position of each token: its request's start plus its offset among the request's new tokens
        offsets = torch.arange(int(lens.sum()), device=device) - batch.query_start_loc[:-1].repeat_interleave(lens)
        decodes, tiles = [], []  # from the host lists: O(requests + tiles), no device read
        row = 0
        for i, (num, start) in enumerate(zip(batch.query_lens, batch.start_positions)):
            if num == 1:
                decodes.append(row)
            for t in range(0, num if num > 1 else 0, self.block_m):
                tiles.append((i, row + t, min(self.block_m, num - t), start + t))
            row += num
        tile_columns = list(zip(*tiles)) if tiles else [(), (), (), ()]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return TritonAttentionMetadata(
            batch.slot_mapping, batch.block_table.contiguous(), token_request.to(torch.int32),
            starts.repeat_interleave(lens) + offsets, column(decodes, torch.int64),
            column(tile_columns[0], torch.int32), column(tile_columns[1], torch.int64),
            column(tile_columns[2], torch.int32), column(tile_columns[3], torch.int64),
        )

    supports_graphs = True

    def graph_metadata(
        self, batch_size: int, max_blocks: int, block_size: int, device: torch.device,
    ) -> TritonAttentionMetadata:
        rows = torch.arange(batch_size, device=device)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return TritonAttentionMetadata(
            torch.full((batch_size,), -1, dtype=torch.int64, device=device),
            torch.zeros(batch_size, max_blocks, dtype=torch.int64, device=device), rows.to(torch.int32),
            torch.zeros(batch_size, dtype=torch.int64, device=device), rows,
            empty.to(torch.int32), empty, empty.to(torch.int32), empty,
        )

    def fill_graph_metadata(self, metadata: TritonAttentionMetadata, batch: AttentionBatch) -> None:
        n, width = batch.block_table.shape
        metadata.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        metadata.slot_mapping[n:].fill_(-1)
        metadata.block_table[:n, :width].copy_(batch.block_table, non_blocking=True)
        torch.sub(batch.seq_lens, 1, out=metadata.token_position[:n])
        metadata.token_position[n:].zero_()  # padding reads position 0 of its row's first block

    # compile-time constants of both kernels (`kernel_limits`): the plain kernels are unchanged
    supports_sliding_window = True
    supports_softcap = True

    def forward(self, q, k, v, kv_cache, metadata: TritonAttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        limits = kernel_limits(window, softcap)
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        if num_tokens:
            write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if q.stride(2) != 1:
            q = q.contiguous()
        shared = dict(GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                      BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=self.block_n,
                      **limits)
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), metadata.block_table.stride(0), scale)
        if metadata.decode_tokens.numel():
            _paged_attention[(metadata.decode_tokens.numel(), num_heads)](
                out, q, kv_cache[0], kv_cache[1], metadata.block_table, metadata.decode_tokens,
                metadata.token_request, metadata.token_position, *strides, **shared,
            )
        if metadata.tile_request.numel():
            _paged_attention_tiled[(metadata.tile_request.numel(), num_heads)](
                out, q, kv_cache[0], kv_cache[1], metadata.block_table, metadata.tile_request, metadata.tile_token,
                metadata.tile_rows, metadata.tile_position, *strides, **shared, BLOCK_M=self.block_m,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
            )
        return out
