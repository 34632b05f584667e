"""Batched multi-LoRA products in Triton: every token of a flat batch gets the LoRA update
of its own adapter slot in one pair of launches, whatever mix of adapters the batch holds
(``ember.plugin.backend.BaseBackend.lora_op``'s contract). For each token ``t`` whose slot
``s = token_slots[t]`` is not -1::

    y[t] += (x[t] @ a[s * rank : (s + 1) * rank].T) @ bt[s * rank : (s + 1) * rank]

The method is Punica's BGMV (batched gather matrix-vector: each token gathers its adapter's
matrices by slot; Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023) as vLLM splits it
into a LoRA "shrink" and "expand" kernel; written here from that description, not copied:

- ``_shrink``: one program per (token, block of ``BLOCK_R`` ranks) computes
  ``x[t] @ A_s.T`` for those ranks, walking ``in`` ``BLOCK_K`` columns at a time, into a
  float32 buffer (T, rank).
- ``_expand``: one program per (token, block of ``BLOCK_N`` outputs) reads the token's
  whole float32 row of the buffer and adds ``buf[t] @ Bt_s[:, block]`` to ``y``'s block
  (read, added in float32, written back in ``y``'s dtype).

Tokens of slot -1 (the base model) are skipped by both: their rows of ``y`` are never
written. Products are elementwise multiplies and sums in float32 (no ``tl.dot``: one
token is a matrix-vector product, and Triton's interpreter has no bf16/fp16 ``tl.dot``),
so the same source runs on NVIDIA, AMD and Intel GPUs and on CPU tensors under
``TRITON_INTERPRET=1`` (set before triton is imported), where it is tested.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(
    x_ptr, a_ptr, slots_ptr, buf_ptr,
    stride_x,  # elements between consecutive tokens of x
    K,  # in: columns of x and a
    RANK: tl.constexpr,  # rows of a per slot (the buffer's row length)
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        a_rows = a_ptr + (slot * RANK + r)[:, None] * K  # slot is int64: no overflow
        x_row = x_ptr + token.to(tl.int64) * stride_x
        acc = tl.zeros((BLOCK_R,), tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_mask = k < K
            xk = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            ak = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(ak * xk[None, :], axis=1)
        tl.store(buf_ptr + token.to(tl.int64) * RANK + r, acc, mask=r_mask)


@triton.jit
def _expand(
    y_ptr, buf_ptr, bt_ptr, slots_ptr,
    stride_y,  # elements between consecutive tokens of y
    N,  # out: columns of y and bt
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,  # RANK rounded up to a power of two: the whole row of the buffer
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        t = tl.load(buf_ptr + token.to(tl.int64) * RANK + r, mask=r_mask, other=0.0)
        b = tl.load(bt_ptr + (slot * RANK + r)[:, None] * N + n[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(t[:, None] * b, axis=0)
        y_row = y_ptr + token.to(tl.int64) * stride_y + n
        y = tl.load(y_row, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_row, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def block_sizes(rank: int) -> dict[str, int]:
    """The kernels' blocks for ``rank``: the expand reads a token's whole rank row
    (``rank_block``: the next power of two >= rank, at least 16), the shrink at most 64
    ranks per program; each program's tile of ``a`` or ``bt`` is at most 8192 elements."""
    rank_block = max(16, triton.next_power_of_2(rank))
    shrink_r = min(rank_block, 64)
    return {"shrink_r": shrink_r, "shrink_k": 8192 // shrink_r, "rank_block": rank_block,
            "expand_n": max(16, min(128, 8192 // rank_block))}


def lora_op(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
            token_slots: torch.Tensor, rank: int, slot_ranks: torch.Tensor | None = None) -> None:
    """``y`` (T, out) += each token's LoRA product, in place (the module docstring; the
    contract of ``BaseBackend.lora_op``). ``x`` (T, in); ``a`` (slots * rank, in) and ``bt``
    (slots * rank, out) with the scale folded into ``bt``; ``token_slots`` (T,) int64, -1 for
    the base model. ``x`` and ``y`` may be row-strided views; nothing is read back to the host.
    ``slot_ranks`` (the rows of each slot in use) is not read: the rows past them are zero."""
    num_tokens, k = x.shape
    n = y.shape[1]
    if (y.shape[0] != num_tokens or token_slots.shape != (num_tokens,) or rank < 1 or a.shape[1] != k
            or bt.shape[1] != n or a.shape[0] != bt.shape[0] or a.shape[0] % rank):
        raise ValueError(f"lora_op: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, bt "
                         f"{tuple(bt.shape)}, token_slots {tuple(token_slots.shape)}, rank {rank} do not fit")
    if num_tokens == 0 or n == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    target = y if y.stride(1) == 1 else y.contiguous()
    a, bt, token_slots = a.contiguous(), bt.contiguous(), token_slots.contiguous()
    blocks = block_sizes(rank)
    buf = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    _shrink[(num_tokens, triton.cdiv(rank, blocks["shrink_r"]))](
        x, a, token_slots, buf, x.stride(0), k,
        RANK=rank, BLOCK_R=blocks["shrink_r"], BLOCK_K=blocks["shrink_k"],
    )
    _expand[(num_tokens, triton.cdiv(n, blocks["expand_n"]))](
        target, buf, bt, token_slots, target.stride(0), n,
        RANK=rank, BLOCK_R=blocks["rank_block"], BLOCK_N=blocks["expand_n"],
    )
    if target is not y:
        y.copy_(target)
