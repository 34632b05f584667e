"""The CPU backend: the reference implementation every other backend is checked against.

Attention writes each step's K/V into the paged cache, then runs PyTorch's
``scaled_dot_product_attention`` for prefill queries (one request at a time) and, for
single-token (decode) queries of all requests, either the native kernel that reads the
paged cache in place (float32) or SDPA over gathered K/V. Native kernels
(``ember.hardware.cpu_kernels``, compiled at first use) also serve small-batch linears
over bf16 weight copies, fused RMSNorm/RoPE/SiLU and greedy sampling; with
``EMBER_CPU_NATIVE=0``, or where they cannot be built, PyTorch runs everything.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.hardware import cpu_graphs, cpu_int_quant, cpu_kernels, cpu_quant
from ember.hardware.cpu_kernels import onednn_linear, onednn_linear_works
from ember.hardware.cpu_linear import PackedLinear, RowInvariantLinear, SmallBatchLinear, packing_works
from ember.hardware.cpu_paths import select_path
from ember.models.layers import Linear
from ember.plugin import hookimpl
from ember.plugin.backend import AttentionBatch, BaseAttention, BaseBackend

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float": torch.float32}
_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Gathered K + V bytes per group of decode requests (see CPUAttention.forward).
DECODE_GROUP_BYTES = int(os.environ.get("EMBER_CPU_DECODE_GROUP_BYTES", 4 << 20))
# Products of at most this many rows read plain bf16 weights through the native
# kernel: SmallBatchLinear (fp32 path) and PackedLinear (bf16 path, where oneDNN's
# packed product was as fast at 4 rows and faster at 8).
SMALL_BATCH_ROWS = {"fp32": 4, "bf16": 2}
# A request with at most this many new tokens after a cached context (a decode, or a
# decode with draft tokens to verify) attends row by row through the decode kernel:
# no gather of its context, and each row's numbers as a decode would get them.
DECODE_ROWS_MAX = 16
# the largest activation a prompts-only step should make (CPUBackend.prefill_step_tokens):
# glibc's largest mmap threshold, past which every allocation is paged in anew
PREFILL_ACTIVATION_BYTES = 32 << 20
if os.environ.get("EMBER_CPU_SMALL_BATCH_ROWS"):
    SMALL_BATCH_ROWS = dict.fromkeys(SMALL_BATCH_ROWS, int(os.environ["EMBER_CPU_SMALL_BATCH_ROWS"]))


@dataclass(slots=True)
class PrefillGroup:
    token_start: int
    token_end: int
    start_position: int
    # flat slot ids of the tokens cached before this chunk; None when there are none
    cached_slots: torch.Tensor | None


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
    (``paged_decode_attention``); without, it gathers K/V and runs SDPA."""

    name = "cpu"

    def __init__(self, kernels=None, row_invariant: bool = False) -> None:
        self.kernels = kernels
        # every token attends as a decode of its own (EMBER_BATCH_INVARIANT): the same
        # numbers whether it is computed in a prompt, a chunk, a verification or alone
        self.row_invariant = row_invariant

    def _rows_as_decodes(self, batch: AttentionBatch) -> CPUAttentionMetadata:
        requests, lens = [], []
        for i, (num_query, start) in enumerate(zip(batch.query_lens, batch.start_positions)):
            requests.extend([i] * num_query)
            lens.extend(range(start + 1, start + num_query + 1))
        device = batch.device
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
        if self.row_invariant and n:
            return self._rows_as_decodes(batch)
        if n and sum(batch.query_lens) == n and min(batch.start_positions) > 0:  # decodes only: the common step
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
        for i, (num_query, start) in enumerate(zip(batch.query_lens, batch.start_positions)):
            if start > 0 and num_query <= DECODE_ROWS_MAX:
                # a decode, or a few tokens after a cached context (a decode with draft
                # tokens to verify): each row attends as a decode over its own context,
                # reading the paged cache in place, with the numbers a decode would get
                decode_rows.extend(range(row, row + num_query))
                decode_requests.extend([i] * num_query)
                decode_lens.extend(range(start + 1, start + num_query + 1))
            else:
                cached = batch.context_slots(i)[:start] if start > 0 else None
                prefills.append(PrefillGroup(row, row + num_query, start, cached))
            row += num_query
        metadata = CPUAttentionMetadata(batch.slot_mapping, None, None, None, prefills, block_size)
        if decode_rows:  # with prefills beside them
            device = batch.device
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
            torch.lt(torch.arange(max_len, device=batch.device)[None, :], metadata.decode_lens[:, None],
                     out=metadata.decode_mask.view(-1, max_len))

    def forward(self, q, k, v, kv_cache, metadata: CPUAttentionMetadata, scale: float) -> torch.Tensor:
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
                                                  metadata.decode_lens, scale)
        out = torch.empty_like(q)
        is_gqa = q.shape[1] != num_kv_heads
        # Prefill attention runs as one 4-D (batch 1) product: PyTorch's CPU flash
        # kernel takes 4-D inputs (blocked over keys, the causal or context mask read
        # block by block), while 3-D ones fell to the math path, which materializes
        # every score: 3x slower at a 2048-token context, and growing with it.
        for group in metadata.prefills:
            qs = q[group.token_start : group.token_end].transpose(0, 1)[None]
            ks = k[group.token_start : group.token_end].transpose(0, 1)[None]
            vs = v[group.token_start : group.token_end].transpose(0, 1)[None]
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
                                                           metadata.decode_lens, scale)
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
            group = max(1, DECODE_GROUP_BYTES // row_bytes)
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
                o = F.scaled_dot_product_attention(
                    qd, ks.transpose(1, 2).to(q.dtype), vs.transpose(1, 2).to(q.dtype),
                    attn_mask=mask[start:end], scale=scale,
                )
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


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes(field: str) -> int | None:
    """VmRSS / VmHWM of this process from /proc/self/status, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class CPUBackend(BaseBackend):
    """Always available. dtype ``auto`` is float32.

    A bfloat16 model runs on one of two paths (``ember.hardware.cpu_paths``), chosen
    at startup from the CPU's flags and logged: ``bf16`` (AMX or AVX512-BF16: bf16
    math on weights prepacked for oneDNN, a bf16 KV cache) or ``fp32`` (elsewhere:
    bf16 is a storage dtype, and matrix multiplies, activations and the KV cache use
    float32, since PyTorch's bf16 GEMM is several times slower than its fp32 GEMM
    there). ``EMBER_CPU_PATH=bf16|fp32`` forces one.
    """

    name = "cpu"
    priority = 0
    distributed_backend = "gloo"
    # a 512-token chunk already runs the GEMMs near their peak here, and keeps a long
    # prompt from stalling running streams for seconds (benchmarks/bench_scheduler.py)
    default_step_tokens = 512
    # with no stream decoding, a prompt computes in chunks of up to 4096 tokens: on
    # SmolLM2 bf16 (AVX512-BF16 EPYC) 2048-token prompts ran 20% faster than in
    # 512-token chunks, 4096-token ones 14% (benchmarks/bench_prefill.py); fewer
    # where the widest activation would outgrow PREFILL_ACTIVATION_BYTES (prefill_step_tokens)
    default_prefill_step_tokens = 4096

    def __init__(self) -> None:
        self._path: str | None = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def prefill_step_tokens(self, hf_config, compute_dtype: torch.dtype) -> int:
        # glibc maps every allocation over 32 MiB (its largest mmap threshold) afresh
        # and unmaps it when freed, so a step whose activations are that large pays a
        # page fault per 4 KiB of each, every layer: SmolLM2 in float32 at 4096 tokens
        # (gate|up: 50 MB) spent 2.5 of 10.2 s of a 7808-token prefill casting into such
        # buffers. Halve the step (down to 1024 tokens) until the widest activation, the
        # MLP's gate|up product, fits: SmolLM2 then prefills 4096 tokens a step in
        # bfloat16, 2048 in float32 (offline, 128 prompts, Q4_1: 548 against 422 tok/s)
        width = 2 * (getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size)
        per_token = width * compute_dtype.itemsize
        tokens = self.default_prefill_step_tokens
        while tokens > 1024 and tokens * per_token > PREFILL_ACTIVATION_BYTES:
            tokens //= 2
        return tokens

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype | None) -> torch.dtype:
        if requested == "auto":
            return torch.float32
        dtype = _DTYPES.get(requested)
        if dtype is None:
            raise ValueError(
                f"dtype {requested!r} is not supported by the cpu backend; choose one of: auto, float32, bfloat16"
            )
        return dtype

    @property
    def path(self) -> str:
        """``bf16`` or ``fp32``: how this backend runs a bf16 model (chosen once, logged)."""
        if self._path is None:
            self._path, why = select_path()
            logger.info("cpu backend: %s path for bf16 models (%s)", self._path, why)
        return self._path

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype != torch.bfloat16:
            return dtype
        return torch.bfloat16 if self.path == "bf16" else torch.float32

    def linear_op(self):
        if self.batch_invariant:
            return RowInvariantLinear(cpu_kernels.load())
        # oneDNN's linear beat F.linear (MKL sgemm) at every batch size measured on a
        # 2-core AVX2 EPYC: 1 row 30 vs 38 ms, 32 rows 105 vs 139 ms, 128 rows 258 vs
        # 307 ms per SmolLM2 forward's projections. Private op: F.linear where absent.
        if os.environ.get("EMBER_CPU_LINEAR", "onednn") == "onednn" and onednn_linear_works():
            return onednn_linear
        return F.linear

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        if dtype != torch.bfloat16 or self.batch_invariant:
            return
        if self.compute_dtype(dtype) == torch.bfloat16:
            self._pack_weights(model)
            return
        # A bf16 model computed in fp32 keeps a bf16 copy of each matmul weight for
        # products of few rows (decode of a small batch), which are bound by reading
        # the weights: see SmallBatchLinear and ember.hardware.cpu_kernels. Costs
        # half the weights' fp32 bytes again; EMBER_CPU_NATIVE=0 turns it off.
        rows = SMALL_BATCH_ROWS["fp32"]
        kernels = cpu_kernels.load() if rows > 0 else None
        if kernels is None:
            return
        op = SmallBatchLinear(model.linear_op, kernels, rows)
        for weight in model.matmul_weights():
            if weight.dtype == torch.float32 and weight.dim() == 2:
                op.add(weight)
        model.set_linear_op(op)

    def _pack_weights(self, model) -> None:
        # The bf16 path: every Linear's weight is replaced by its oneDNN-packed form; a
        # weight read elsewhere too (a tied LM head) gets a packed copy. Products of up
        # to SMALL_BATCH_ROWS rows read plain bf16 weights kept beside the packed ones
        # (PackedLinear; twice the weights' bytes, as the fp32 path's float32 weights
        # and bf16 copies take three times). EMBER_CPU_SMALL_BATCH_ROWS=0 keeps the
        # packed weights only; EMBER_CPU_LINEAR=plain keeps plain weights only (F.linear).
        if os.environ.get("EMBER_CPU_LINEAR", "onednn") != "onednn" or not packing_works():
            logger.info("cpu backend: bf16 weights kept in plain layout (F.linear)")
            return
        rows = SMALL_BATCH_ROWS["bf16"]
        op = PackedLinear(model.linear_op, cpu_kernels.load() if rows > 0 else None, rows)
        packed = 0
        for module in model.modules():
            if isinstance(module, Linear) and not module.is_quantized and module.weight.dtype == torch.bfloat16:
                module.set_packed_weight(op.pack(module.weight))
                packed += 1
        copies = [w for w in model.matmul_weights() if not w.is_mkldnn and w.dtype == torch.bfloat16]
        for weight in copies:
            op.add(weight)
        model.set_linear_op(op)
        logger.info(
            "cpu backend: %d bf16 weights packed for oneDNN, %d packed copies; plain weights kept for products "
            "of up to %d rows: %.1f MiB", packed, len(copies), op.max_rows, op.plain_bytes / 2**20,
        )

    def quantized_linear_op(self, format: str, compute_dtype: torch.dtype):
        op = quantized_ops().get(format)
        return op() if op is not None else None

    def quantized_formats(self, compute_dtype: torch.dtype) -> tuple[str, ...]:
        return tuple(sorted(quantized_ops()))

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # Converting every bf16 weight to fp32 on every forward read and wrote three
        # times the weights' bytes per step: at batch 1 that was most of a decode
        # step. Weights rounded to bf16 are kept in fp32 (twice the memory of bf16).
        return self.compute_dtype(dtype)

    def kv_cache_dtype(self, dtype: torch.dtype, requested: str = "auto", quantized: bool = False) -> torch.dtype:
        # K and V are produced in the compute dtype. A float32 model may keep them in
        # 16 bits (bfloat16 or float16): the native kernels widen them in registers, and
        # a batch's decode attention, which streams every cached token from memory, reads
        # half the bytes (128 requests x 100 tokens, SmolLM2's heads, AVX-512 EPYC: 1.58
        # ms a layer over float32, 0.52 over bfloat16). "auto" does so for quantized
        # weights, in float16 (llama.cpp's default cache type beside float32
        # activations; 3 more mantissa bits than bfloat16), and keeps a float model's
        # numbers (the compute dtype) otherwise; the bf16 path stores bfloat16.
        compute = self.compute_dtype(dtype)
        if requested == "auto":
            if quantized and compute == torch.float32 and cpu_kernels.load() is not None:
                return torch.float16
            return compute
        chosen = _KV_DTYPES.get(requested)
        if chosen is None:
            raise ValueError(f"kv_cache_dtype {requested!r} is not one of: auto, {', '.join(_KV_DTYPES)}")
        if chosen != compute and not (compute == torch.float32 and chosen in (torch.bfloat16, torch.float16)):
            raise ValueError(f"kv_cache_dtype {requested!r}: this model computes in "
                             f"{str(compute).removeprefix('torch.')} on the cpu backend, whose KV cache is then "
                             f"{str(compute).removeprefix('torch.')} (a 16-bit cache goes beside float32 compute)")
        return chosen

    def kv_cache_memory_bytes(self, model_bytes: int, activation_bytes: int = 0) -> int:
        # A quarter of the RAM still available (weights are loaded by now) once the
        # largest step's activations are set aside, capped at 2 GiB: the CPU shares
        # memory with everything else on the host, and the cache is zeroed at start.
        free = max(0, available_memory_bytes() - activation_bytes)
        return int(max(256 << 20, min(2 << 30, free // 4)))

    def peak_memory_of(self, run) -> int | None:
        # The process's resident-set peak (VmHWM), reset first through clear_refs
        # (Linux); None where /proc does not allow it.
        if not _reset_peak_rss():
            run()
            return None
        before = _rss_bytes("VmRSS")
        run()
        peak = _rss_bytes("VmHWM")
        return None if before is None or peak is None else max(0, peak - before)

    def configure_threads(self, num_threads: int | None) -> int:
        # PyTorch's default is every core of the host: in a container limited to 2
        # CPUs of a 64-core machine that is 64 threads fighting over 2 CPUs. Ember
        # takes the physical cores it may run on, within the cgroup's CPU quota,
        # unless the user said otherwise (num_threads, else OMP_NUM_THREADS).
        source = "asked"
        if num_threads is None:
            if os.environ.get("OMP_NUM_THREADS"):
                source = "OMP_NUM_THREADS"
            else:
                num_threads, source = cpu_thread_count(), "physical cores available"
        if num_threads is not None and num_threads != torch.get_num_threads():
            torch.set_num_threads(num_threads)
        try:
            # Ember runs no inter-op parallel work; a second pool only adds threads.
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # only settable before the first inter-op work; then it stays
        logger.info("cpu backend: %d threads (%s)", torch.get_num_threads(), source)
        return torch.get_num_threads()

    def layer_ops(self, compute_dtype: torch.dtype) -> dict:
        # each replaces 3 to 12 small PyTorch ops, whose per-op cost was most of a
        # one-request decode step once the weights were read fast (fp32 and bf16 paths)
        kernels = cpu_kernels.load()
        if kernels is None or compute_dtype not in cpu_kernels.KERNEL_DTYPES:
            return {}
        return {"rms_norm": kernels.rms_norm, "rope_": kernels.rope_, "silu_mul": kernels.silu_mul,
                "embedding": kernels.embedding}

    # decode batch sizes captured as CPU graphs when the user names none: a graph saves
    # the Python around a forward's native calls, which matters while the kernels are
    # quick (few rows); past 32 rows a step's products take far longer than that Python
    graph_batch_sizes = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)

    def graph_capture(self):
        # CPU graphs (ember.hardware.cpu_graphs): a forward that runs on the native
        # kernels only (GGUF weights, bf16 weights at few rows) replays as one C call;
        # one that runs PyTorch's ops (a float32 GEMM) is refused and runs eagerly
        if cpu_kernels.load() is None:
            return None
        return cpu_graphs.capture

    def greedy_op(self):
        kernels = cpu_kernels.load()
        return kernels.greedy if kernels is not None else None

    def create_attention(self) -> BaseAttention:
        return CPUAttention(cpu_kernels.load(), row_invariant=self.batch_invariant)

    @property
    def batch_invariant(self) -> bool:
        """``EMBER_BATCH_INVARIANT=1``: every token's numbers independent of what shares
        its step (its batch mates, its prompt's chunking, draft positions beside it,
        a recomputation after preemption): row-by-row products and decode-style
        attention for every token. Slower; for checking that scheduling and
        speculation never change outputs (docs/speculative.md)."""
        value = os.environ.get("EMBER_BATCH_INVARIANT", "0").strip()
        if value not in ("0", "1", ""):
            raise ValueError(f"EMBER_BATCH_INVARIANT must be 0 or 1, got {value!r}")
        if value == "1" and not getattr(self, "_said_invariant", False):
            self._said_invariant = True
            logger.info("cpu backend: batch-invariant mode (EMBER_BATCH_INVARIANT=1): row-by-row products, "
                        "every token's attention as a decode")
        return value == "1"


def quantized_ops() -> dict:
    """The quantized formats the CPU backend runs (docs/quantization.md), by format: the
    integer grids through PyTorch's weight-only kernels (ember.hardware.cpu_int_quant)."""
    ops = dict(cpu_int_quant.linear_ops())
    ops.update(cpu_quant.linear_ops())  # GGUF quant types, native kernels (ember.hardware.cpu_quant)
    return ops


def cpu_thread_count(sys_root: str = "/sys") -> int:
    """Physical cores this process may run on (its affinity mask, SMT siblings counted
    once), capped by a cgroup CPU quota (v2 ``cpu.max`` or v1 ``cfs_quota_us``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{sys_root}/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    count = len(cores) or 1
    quota = cgroup_cpu_quota(sys_root)
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return count


def cgroup_cpu_quota(sys_root: str = "/sys") -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None without a limit."""
    try:
        with open(f"{sys_root}/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{sys_root}/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open(f"{sys_root}/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_memory_bytes() -> int:
    """Memory the kernel can hand out without swapping: /proc/meminfo's MemAvailable
    (free pages plus reclaimable cache), else free pages, else 8 GiB."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


@hookimpl
def ember_register_backends(registry) -> None:
    registry.register("cpu", CPUBackend)
