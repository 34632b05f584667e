"""FlashAttention 2 (the ``flash-attn`` package, Dao-AILab) over Ember's paged KV
cache, for the CUDA and ROCm backends where the package is installed.

Two of flash-attn's documented entry points, both reading the cache through a block
table:

- ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, softmax_scale=, causal=True, block_table=)`` for any
  step with prompts or prompt chunks: the queries are the flat batch, each request's
  keys its whole context (cached and new), and ``causal`` aligns the mask to the
  bottom right, so that a chunk after a cached context sees the context and its own
  earlier tokens.
- ``flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=,
  block_table=, softmax_scale=, causal=True)`` for decode-only steps (one query per
  request): fixed shapes, so a decode step can be captured in a device graph.

Ember's cache ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` is already
flash-attn's paged layout (``k_cache = kv_cache[0]``: ``(num_blocks, page_block_size,
nheads_k, headdim)``). flash-attn 2 requires ``page_block_size`` to be a multiple of
256, so this attention's KV blocks default to 256 tokens (``block_size_multiple``;
prefix caching then shares whole 256-token blocks). It writes K/V into the cache with
the Triton kernel the Triton attention uses, and runs float32 models (which flash-attn
does not take) and head sizes over 256 through the Triton attention.

Sliding windows and soft-capping go to both entry points as flash-attn documents them:
``window_size=(window - 1, 0)`` (with ``causal``, the query at position ``p`` sees keys
``p - (window - 1) .. p``: Ember's ``p - window < j <= p``) and ``softcap=`` (flash-attn
computes ``softcap * tanh(s / softcap)`` of the scaled score ``s``, 2.6 and later).
A flash-attn without ``softcap`` (before 2.6, or a build that refuses it) runs the
capped layers through the Triton attention, said once in the log.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass

import torch

from ember.plugin.backend import AttentionBatch, BaseAttention

logger = logging.getLogger(__name__)

PAGE_BLOCK_MULTIPLE = 256  # flash-attn 2: "Paged KV cache block size must be divisible by 256"
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class FlashAttentionMetadata:
    batch: AttentionBatch | None  # None: a device graph's static metadata
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    decode_only: bool
    block_table: torch.Tensor  # (num_requests, max_blocks) int32
    seq_lens: torch.Tensor  # (num_requests,) int32: context of each request (cached + new)
    cu_seqlens_q: torch.Tensor  # (num_requests + 1,) int32
    cu_seqlens_k: torch.Tensor  # (num_requests + 1,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    fallback: object = None  # the Triton attention's metadata, built when a layer needs it


class FlashAttention(BaseAttention):
    """``BaseAttention`` through flash-attn. ``module``: the ``flash_attn`` module
    (imported when None); ``ImportError`` where it is not installed."""

    name = "flash-attn"
    default_block_size = PAGE_BLOCK_MULTIPLE
    block_size_multiple = PAGE_BLOCK_MULTIPLE

    def __init__(self, module=None) -> None:
        module = module or importlib.import_module("flash_attn")
        self.varlen = module.flash_attn_varlen_func
        self.with_kvcache = module.flash_attn_with_kvcache
        # softcap= arrived in flash-attn 2.6 (window_size= in 2.3, before the paged cache)
        self.has_softcap = all(_takes(f, "softcap") for f in (self.varlen, self.with_kvcache))

        from ember.hardware.triton_attention import TritonAttention, kernel_limits, write_kv

        self.write_kv = write_kv
        self.check_limits = kernel_limits  # the same ValueError for a bad window or cap
        self.fallback = TritonAttention()
        self._warned: set[str] = set()

    def prepare(self, batch: AttentionBatch) -> FlashAttentionMetadata:
        device = batch.device
        seq_lens = batch.seq_lens.to(torch.int32)
        cu_seqlens_k = torch.zeros(len(batch.query_lens) + 1, dtype=torch.int32, device=device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens_k[1:])
        max_seqlen_k = max((s + n for s, n in zip(batch.start_positions, batch.query_lens)), default=0)
        return FlashAttentionMetadata(
            batch, batch.slot_mapping, all(n == 1 for n in batch.query_lens), batch.block_table.to(torch.int32),
            seq_lens,
            batch.query_start_loc.to(torch.int32), cu_seqlens_k, max(batch.query_lens, default=0), max_seqlen_k,
        )

    supports_graphs = True

    def graph_metadata(
        self, batch_size: int, max_blocks: int, block_size: int, device: torch.device,
    ) -> FlashAttentionMetadata:
        seq_lens = torch.ones(batch_size, dtype=torch.int32, device=device)  # padding reads slot 0 of its block
        fallback = self.fallback.graph_metadata(batch_size, max_blocks, block_size, device)
        return FlashAttentionMetadata(
            None, fallback.slot_mapping, True, torch.zeros(batch_size, max_blocks, dtype=torch.int32, device=device),
            seq_lens, torch.arange(batch_size + 1, dtype=torch.int32, device=device),
            torch.zeros(batch_size + 1, dtype=torch.int32, device=device), 1, 0, fallback,
        )

    def fill_graph_metadata(self, metadata: FlashAttentionMetadata, batch: AttentionBatch) -> None:
        self.fallback.fill_graph_metadata(metadata.fallback, batch)  # slot_mapping is shared with it
        n, width = batch.block_table.shape
        metadata.block_table[:n, :width].copy_(batch.block_table, non_blocking=True)
        metadata.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        metadata.seq_lens[n:].fill_(1)

    supports_sliding_window = True
    supports_softcap = True  # by flash-attn 2.6+, else by the Triton attention

    def _unsupported(self, q: torch.Tensor, softcap: float | None = None) -> str | None:
        if softcap is not None and not self.has_softcap:
            return "logit soft-capping (this flash-attn has no softcap; 2.6 and later do)"
        if q.dtype not in _DTYPES:
            return f"{q.dtype} (flash-attn runs float16 and bfloat16)"
        if q.shape[-1] > MAX_HEAD_DIM or q.shape[-1] % 8:
            return f"head size {q.shape[-1]} (flash-attn runs multiples of 8 up to {MAX_HEAD_DIM})"
        return None

    def forward(self, q, k, v, kv_cache, metadata: FlashAttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        self.check_limits(window, softcap)
        limits = {} if window is None else {"window": window}
        if softcap is not None:
            limits["softcap"] = softcap
        reason = self._unsupported(q, softcap)
        if reason is not None:
            return self._run_triton(reason, q, k, v, kv_cache, metadata, scale, limits)
        if q.shape[0]:
            self.write_kv(k, v, kv_cache, metadata.slot_mapping)
        # flash-attn's (left, right) window: with causal, right 0 and left window - 1 keys before p
        flash_limits = {} if window is None else {"window_size": (window - 1, 0)}
        if softcap is not None:
            flash_limits["softcap"] = float(softcap)
        try:
            if metadata.decode_only:
                return self.with_kvcache(
                    q.unsqueeze(1), kv_cache[0], kv_cache[1], cache_seqlens=metadata.seq_lens,
                    block_table=metadata.block_table, softmax_scale=scale, causal=True, **flash_limits,
                ).squeeze(1)
            return self.varlen(
                q, kv_cache[0], kv_cache[1], metadata.cu_seqlens_q, metadata.cu_seqlens_k, metadata.max_seqlen_q,
                metadata.max_seqlen_k, softmax_scale=scale, causal=True, block_table=metadata.block_table,
                **flash_limits,
            )
        except RuntimeError as exc:  # a build compiled without soft-capping says so when called with it
            if softcap is None or "softcap" not in str(exc):
                raise
            self.has_softcap = False
            # K/V are written already; the Triton attention writes the same rows to the same slots again
            return self._run_triton(f"logit soft-capping ({exc})", q, k, v, kv_cache, metadata, scale, limits)

    def _run_triton(self, reason: str, q, k, v, kv_cache, metadata: FlashAttentionMetadata, scale: float,
                    limits: dict) -> torch.Tensor:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.info("attention: %s runs the Triton kernels", reason)
        if metadata.fallback is None:
            metadata.fallback = self.fallback.prepare(metadata.batch)
        return self.fallback.forward(q, k, v, kv_cache, metadata.fallback, scale, **limits)


def _takes(function, name: str) -> bool:
    """Whether ``function`` accepts the keyword ``name`` (True where its signature is unreadable)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
