"""The CPU backend's paged attention (``CPUAttention``), also the PyTorch-only
attention of device backends without Triton (``kernels=None``).

Each step writes its K/V into the paged cache, then runs PyTorch's
``scaled_dot_product_attention`` for prefill queries (one request at a time) and, for
single-token (decode) queries of all requests, either the native kernel that reads the
paged cache in place (``ember.hardware.cpu_kernels``) or SDPA over gathered K/V.
Everything a step calls lives here or in the kernels' module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.hardware.cpu_options import DEFAULT_DECODE_GROUP_BYTES
from ember.plugin.backend import AttentionBatch, BaseAttention

# A request with at most this many new tokens after a cached context (a decode, or a
# decode with draft tokens to verify) attends row by row through the decode kernel:
# no gather of its context, and each row's numbers as a decode would get them.
DECODE_ROWS_MAX = 16


@dataclass(slots=True)
class PrefillGroup:
    token_start: int
    token_end: int
    start_position: int
    # flat slot ids of the tokens cached before this chunk; None when there are none
    cached_slots: torch.Tensor | None
    # position spans whose tokens attend both ways (AttentionBatch.bidirectional_spans); () none
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class CPUAttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    # (num_decodes,) rows of the flat batch; None when there is no decode or every row is one (all_decode)
    decode_token_index: torch.Tensor | None
    decode_tables: torch.Tensor | None  # (num_decodes, max_blocks) int64, rows padded with valid ids
    decode_lens: torch.Tensor | None  # (num_decodes,) int64 context lengths
    prefills: list[PrefillGroup]
    block_size: int
    all_decode: bool = False  # every row of the batch is a decode, in order
    # (num_decodes, 1, 1, max_blocks * block_size) bool, built on first use
    decode_mask: torch.Tensor | None = None
    # a device graph's static metadata: rows with slot -1 are padding (graph_metadata)
    padded: bool = False

    def mask(self) -> torch.Tensor:
        if self.decode_mask is None:
            max_len = self.decode_tables.shape[1] * self.block_size
            lens = self.decode_lens
            self.decode_mask = (torch.arange(max_len, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]
        return self.decode_mask


def _decode_tables(tables: torch.Tensor, max_start: int, block_size: int) -> torch.Tensor:
    """The decodes' block-table rows, cut to the blocks the longest context uses (the
    kernel reads rows of that many ids, contiguous)."""
    max_blocks = -(-(max_start + 1) // block_size)
    if tables.shape[1] != max_blocks:
        tables = tables[:, :max_blocks]
    return tables if tables.is_contiguous() else tables.contiguous()


class CPUAttention(BaseAttention):
    """``kernels``: the native kernels (ember.hardware.cpu_kernels), or None for
    PyTorch only. With them, float32 decode attention reads the paged cache in place
    (``paged_decode_attention``); without, it gathers K/V and runs SDPA, in groups of
    about ``decode_group_bytes``. Device backends without Triton run it with None."""

    name = "cpu"

    def __init__(self, kernels=None, row_invariant: bool = False,
                 decode_group_bytes: int = DEFAULT_DECODE_GROUP_BYTES) -> None:
        self.kernels = kernels
        # every token attends as a decode of its own (option batch_invariant): the same
        # numbers whether it is computed in a prompt, a chunk, a verification or alone
        self.row_invariant = row_invariant
        # gathered K + V bytes per group of decode requests without the native kernel
        # (option decode_group_bytes; see forward)
        self.decode_group_bytes = decode_group_bytes

    def _rows_as_decodes(self, batch: AttentionBatch) -> CPUAttentionMetadata:
        requests, lens = [], []
        for i, (num_query, start) in enumerate(zip(batch.query_lens, batch.start_positions)):
            requests.extend([i] * num_query)
            lens.extend(range(start + 1, start + num_query + 1))
        device = batch.slot_mapping.device  # the CPU; read off a tensor of the batch
        index = torch.tensor(requests, dtype=torch.int64, device=device)
        metadata = CPUAttentionMetadata(
            batch.slot_mapping, torch.arange(len(lens), device=device),
            _decode_tables(batch.block_table[index], max(lens) - 1, batch.block_size),
            torch.tensor(lens, dtype=torch.int64, device=device), [], batch.block_size,
        )
        if self.kernels is None:
            metadata.mask()
        return metadata

    def prepare(self, batch: AttentionBatch) -> CPUAttentionMetadata:
        block_size, n = batch.block_size, len(batch.query_lens)
        if self.row_invariant and n and not batch.bidirectional_spans:  # (spans need a prompt's rows together)
            return self._rows_as_decodes(batch)
        if n and sum(batch.query_lens) == n and min(batch.start_positions) > 0 and not batch.bidirectional_spans:
            tables = _decode_tables(batch.block_table, max(batch.start_positions), block_size)
            metadata = CPUAttentionMetadata(batch.slot_mapping, None, tables, batch.seq_lens, [], block_size, True)
            if self.kernels is None:
                metadata.mask()
            return metadata
        decode_rows: list[int] = []  # flat rows attending as decodes
        decode_requests: list[int] = []  # their request indices
        decode_lens: list[int] = []  # their context lengths
        prefills: list[PrefillGroup] = []
        row = 0
        all_spans = batch.bidirectional_spans
        for i, (num_query, start) in enumerate(zip(batch.query_lens, batch.start_positions)):
            spans = tuple(s for s in all_spans[i] if s[0] < start + num_query and start < s[1]) if all_spans else ()
            if start > 0 and num_query <= DECODE_ROWS_MAX and not spans:
                # a decode, or a few tokens after a cached context (a decode with draft
                # tokens to verify): each row attends as a decode over its own context,
                # reading the paged cache in place, with the numbers a decode would get
                decode_rows.extend(range(row, row + num_query))
                decode_requests.extend([i] * num_query)
                decode_lens.extend(range(start + 1, start + num_query + 1))
            else:
                cached = batch.context_slots(i)[:start] if start > 0 else None
                prefills.append(PrefillGroup(row, row + num_query, start, cached, spans))
            row += num_query
        metadata = CPUAttentionMetadata(batch.slot_mapping, None, None, None, prefills, block_size)
        if decode_rows:  # with prefills beside them
            device = batch.slot_mapping.device  # the CPU; read off a tensor of the batch
            index = torch.tensor(decode_requests, dtype=torch.int64, device=device)
            metadata.decode_lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
            metadata.decode_token_index = torch.tensor(decode_rows, dtype=torch.int64, device=device)
            metadata.decode_tables = _decode_tables(batch.block_table[index], max(decode_lens) - 1, block_size)
            if self.kernels is None:
                metadata.mask()
        return metadata

    supports_graphs = True  # CPU graphs (ember.hardware.cpu_graphs), and Gaudi's HPU graphs of its PyTorch ops

    def graph_metadata(
        self, batch_size: int, max_blocks: int, block_size: int, device: torch.device,
    ) -> CPUAttentionMetadata:
        """Decodes over tables of ``max_blocks`` blocks (the whole context a request
        may have: fixed shapes, at the cost of masking what a shorter one leaves)."""
        metadata = CPUAttentionMetadata(
            torch.full((batch_size,), -1, dtype=torch.int64, device=device), None,
            torch.zeros(batch_size, max_blocks, dtype=torch.int64, device=device),
            torch.ones(batch_size, dtype=torch.int64, device=device), [], block_size, all_decode=True, padded=True,
        )
        if self.kernels is None:
            metadata.mask()
        return metadata

    def fill_graph_metadata(self, metadata: CPUAttentionMetadata, batch: AttentionBatch) -> None:
        n, width = batch.block_table.shape
        metadata.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        metadata.slot_mapping[n:].fill_(-1)
        metadata.decode_tables[:n, :width].copy_(batch.block_table, non_blocking=True)
        metadata.decode_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        metadata.decode_lens[n:].fill_(1)  # padding reads position 0 of its row's first block
        if metadata.decode_mask is not None:  # PyTorch's attention reads the mask; the native kernel does not
            max_len = metadata.decode_mask.shape[-1]
            torch.lt(torch.arange(max_len, device=batch.slot_mapping.device)[None, :], metadata.decode_lens[:, None],
                     out=metadata.decode_mask.view(-1, max_len))

    # sliding windows and soft-capping: the native decode kernel takes both; prompts and
    # the PyTorch-only decodes run `attend_limited` (masked SDPA, or scores by hand with a cap)
    supports_sliding_window = True
    supports_softcap = True
    supports_bidirectional_spans = True  # prompts with spans run `attend_limited` with them

    def forward(self, q, k, v, kv_cache, metadata: CPUAttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        flat_cache = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        kernels = self.kernels
        if kernels is not None and kernels.kv_write_supports(k.dtype, kv_cache.dtype) and k.stride() == v.stride():
            # in place from the fused qkv's views; padding rows (slot -1) write nothing
            kernels.kv_write(k, v, metadata.slot_mapping, flat_cache[0], flat_cache[1])
        else:
            self._write_cache(flat_cache, k.to(kv_cache.dtype), v.to(kv_cache.dtype), metadata)
        native_decode = metadata.decode_lens is not None and kernels is not None \
            and kernels.attention_supports(q.shape[1], num_kv_heads, head_dim, q.dtype, kv_cache.dtype)
        if native_decode and metadata.all_decode:
            return kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], metadata.decode_tables,
                                                  metadata.decode_lens, scale, window, softcap)
        out = torch.empty_like(q)
        is_gqa = q.shape[1] != num_kv_heads
        limited = window is not None or softcap is not None
        # Prefill attention runs as one 4-D (batch 1) product: PyTorch's CPU flash
        # kernel takes 4-D inputs (blocked over keys, the causal or context mask read
        # block by block), while 3-D ones fell to the math path, which materializes
        # every score: 3x slower at a 2048-token context, and growing with it.
        for group in metadata.prefills:
            qs = q[group.token_start : group.token_end].transpose(0, 1)[None]
            ks = k[group.token_start : group.token_end].transpose(0, 1)[None]
            vs = v[group.token_start : group.token_end].transpose(0, 1)[None]
            if limited or group.spans:  # keys from the window's start only: the cached ones it reaches, then the new
                rows = slice(group.token_start, group.token_end)
                lo = 0 if window is None else max(0, group.start_position - window + 1)
                k_all, v_all = k[rows], v[rows]
                if group.cached_slots is not None and lo < group.start_position:
                    ctx = group.cached_slots[lo:]
                    k_all = torch.cat((flat_cache[0][ctx].to(q.dtype), k_all))
                    v_all = torch.cat((flat_cache[1][ctx].to(q.dtype), v_all))
                else:
                    lo = group.start_position
                out[rows] = attend_limited(q[rows], k_all, v_all, group.start_position, lo, scale, window, softcap,
                                           group.spans)
                continue
            if group.cached_slots is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=is_gqa)
            else:
                k_ctx = flat_cache[0][group.cached_slots].transpose(0, 1).to(q.dtype)[None]
                v_ctx = flat_cache[1][group.cached_slots].transpose(0, 1).to(q.dtype)[None]
                o = _attend_after_context(qs, k_ctx, v_ctx, ks, vs, scale, is_gqa)
            out[group.token_start : group.token_end] = o[0].transpose(0, 1)
        if metadata.decode_lens is not None:
            if native_decode:
                rows = metadata.decode_token_index
                out[rows] = kernels.paged_decode_attention(q[rows], kv_cache[0], kv_cache[1], metadata.decode_tables,
                                                           metadata.decode_lens, scale, window, softcap)
                return out
            mask = metadata.mask()
            num_decodes, max_len = mask.shape[0], mask.shape[-1]
            decode_rows = metadata.decode_token_index
            if decode_rows is None:  # all_decode
                decode_rows = torch.arange(num_decodes, device=q.device)
            # Decodes go in groups whose gathered K and V stay in the CPU's cache:
            # gathering all of a 256-request batch at once (tens of MB a layer) and
            # reading it back from memory made this 10x slower than at 128 requests.
            row_bytes = 2 * max_len * num_kv_heads * head_dim * kv_cache.element_size()
            group = max(1, self.decode_group_bytes // row_bytes)
            for start in range(0, num_decodes, group):
                end = min(start + group, num_decodes)
                n = end - start
                block_ids = metadata.decode_tables[start:end].reshape(-1)
                # index_select of whole blocks (2x faster than advanced indexing here),
                # then (n, max_blocks * block_size, kv_heads, D) -> (n, kv_heads, L, D) as a view.
                ks = kv_cache[0].index_select(0, block_ids).view(n, -1, num_kv_heads, head_dim)
                vs = kv_cache[1].index_select(0, block_ids).view(n, -1, num_kv_heads, head_dim)
                # GQA without expanding K/V: the query heads sharing a KV head become that
                # head's query rows, (n, kv_heads, heads_per_kv, D).
                rows = decode_rows[start:end]
                qd = q[rows].view(n, num_kv_heads, -1, head_dim)
                # tensor ops only, no host sync: a device graph may capture this path
                group_mask = mask[start:end]
                if window is not None:  # the last `window` positions of each context
                    first = (metadata.decode_lens[start:end] - window)[:, None, None, None]
                    group_mask = group_mask & (torch.arange(max_len, device=q.device) >= first)
                if softcap is None:
                    o = F.scaled_dot_product_attention(
                        qd, ks.transpose(1, 2).to(q.dtype), vs.transpose(1, 2).to(q.dtype),
                        attn_mask=group_mask, scale=scale,
                    )
                else:  # SDPA cannot cap: the scores by hand, in float32
                    scores = qd.float() @ ks.transpose(1, 2).float().transpose(-1, -2) * scale
                    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~group_mask, float("-inf"))
                    o = (scores.softmax(-1) @ vs.transpose(1, 2).float()).to(q.dtype)
                out[rows] = o.reshape(n, -1, head_dim)
        return out

    @staticmethod
    def _write_cache(flat_cache, kw, vw, metadata: CPUAttentionMetadata) -> None:
        """The step's K/V into the cache with PyTorch (no native kernels, or another dtype)."""
        slots = metadata.slot_mapping
        if metadata.padded:
            # In fixed shapes, padding rows (slot -1) write row 0's K/V to row 0's slot:
            # duplicate indices with equal values, so the write stays exact. Before the
            # first fill (capture) row 0 is padding too: it writes slot 0's own values back.
            valid = slots >= 0
            first = slots[:1].clamp(min=0)
            first_valid = valid[:1, None, None]
            k0 = torch.where(first_valid, kw[:1], flat_cache[0].index_select(0, first))
            v0 = torch.where(first_valid, vw[:1], flat_cache[1].index_select(0, first))
            slots = torch.where(valid, slots, first)
            kw, vw = torch.where(valid[:, None, None], kw, k0), torch.where(valid[:, None, None], vw, v0)
        flat_cache[0].index_copy_(0, slots, kw)
        flat_cache[1].index_copy_(0, slots, vw)


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_after_context(q, k_ctx, v_ctx, k_new, v_new, scale: float, is_gqa: bool) -> torch.Tensor:
    """A prompt chunk's attention (batch-1 4-D tensors) over its cached context, which
    every query sees whole, and over its own tokens, causally: two flash products
    merged by their log-sum-exps. One masked product over context + chunk computed
    every (query, key) block, the masked half too, and built an n_q x n_ctx mask: at
    a 4096-token chunk after 4095 cached tokens, a third more work than causal."""
    if _FLASH is None:  # a torch without the CPU flash op: one masked product
        ks, vs = torch.cat((k_ctx, k_new), 2), torch.cat((v_ctx, v_new), 2)
        mask = torch.ones(q.shape[2], ks.shape[2], dtype=torch.bool).tril(diagonal=ks.shape[2] - q.shape[2])
        return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=scale, enable_gqa=is_gqa)
    if is_gqa:
        group = q.shape[1] // k_ctx.shape[1]
        k_ctx, v_ctx = k_ctx.repeat_interleave(group, 1), v_ctx.repeat_interleave(group, 1)
        k_new, v_new = k_new.repeat_interleave(group, 1), v_new.repeat_interleave(group, 1)
    o_ctx, lse_ctx = _FLASH(q, k_ctx, v_ctx, 0.0, False, scale=scale)[:2]
    o_new, lse_new = _FLASH(q, k_new, v_new, 0.0, True, scale=scale)[:2]
    top = torch.maximum(lse_ctx, lse_new)
    w_ctx, w_new = (lse_ctx - top).exp_(), (lse_new - top).exp_()
    total = w_ctx + w_new
    o = o_ctx.float().mul_((w_ctx / total)[..., None]).add_(o_new.float().mul_((w_new / total)[..., None]))
    return o.to(q.dtype)


LIMITED_ROWS = 256  # query rows per product in attend_limited: scores of at most rows x (rows + window)


def attend_limited(q, k_all, v_all, first_position: int, key_start: int, scale: float,
                   window: int | None, softcap: float | None, spans: tuple = ()) -> torch.Tensor:
    """Causal attention of ``q`` (n, H, D), queries at positions ``first_position ..``, over
    ``k_all``/``v_all`` (ctx, Hkv, D), keys at positions ``key_start ..`` (the last key is
    the last query's), with a sliding ``window`` and/or a logit ``softcap``, and queries in
    one of ``spans`` (``(start, end)`` positions) also over the span's later keys. Queries
    go in groups of `LIMITED_ROWS`, each over the keys its window reaches: masked SDPA, or,
    with a cap, the scores by hand in float32 (SDPA cannot cap)."""
    n, num_heads, _ = q.shape
    group = num_heads // k_all.shape[1]
    out = torch.empty_like(q)
    for a in range(0, n, LIMITED_ROWS):
        b = min(n, a + LIMITED_ROWS)
        q_pos = torch.arange(first_position + a, first_position + b)[:, None]
        lo = key_start if window is None else max(key_start, first_position + a - window + 1)
        hi = first_position + b
        near = [(s, e) for s, e in spans if s < hi and first_position + a < e]  # spans these queries are in
        hi = min(max([hi] + [e for _, e in near]), key_start + k_all.shape[0])
        k_pos = torch.arange(lo, hi)[None, :]
        mask = k_pos <= q_pos
        for s, e in near:
            mask |= (q_pos >= s) & (q_pos < e) & (k_pos >= s) & (k_pos < e)
        if window is not None:
            mask &= k_pos > q_pos - window
        qs = q[a:b].transpose(0, 1)[None]  # (1, H, m, D)
        ks = k_all[lo - key_start : hi - key_start].transpose(0, 1)[None]
        vs = v_all[lo - key_start : hi - key_start].transpose(0, 1)[None]
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        else:
            if group > 1:
                ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            scores = (qs.float() @ ks.float().transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            o = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs.float()).to(q.dtype)
        out[a:b] = o[0].transpose(0, 1)
    return out
