"""Run one scheduled step: update the persistent batch from the step's deltas, gather
the flat batch, forward, mask, sample and verify drafts.

The runner shares no mutable state with the scheduler: it reads a `SchedulerOutput`
and returns a `ModelRunnerOutput` (``ember.sched.step``), keeping its own copy of every
request in an :class:`InputBatch`.

The persistent batch. The scheduler sends a request in full once
(`ember.sched.step.NewRequest`) and deltas afterwards; :class:`InputBatch` keeps what the
runner needs of each request in arrays indexed by a row per request — token ids,
block table — plus the request's token lists for logits processors. A step gathers
its input ids, positions, cache slots and block-table rows from those arrays with a
few vectorized operations and sends them to the device once, so a decode step costs
O(batch) Python whatever the requests' lengths. The arrays live on the host (NumPy,
whose small indexing operations cost a microsecond where a torch operation costs
several; the CPU backend reads the step's tensors without a copy) — the same layout
a device backend copies from, as vLLM's host-side input batch does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ember.logprobs import PositionLogprobs, compute_position_logprobs
from ember.models.base import BaseCausalLM
from ember.plugin.backend import AttentionBatch, BaseAttention, BaseBackend
from ember.plugin.logits_processor import SamplingRow
from ember.sampling_params import SamplingParams
from ember.sched.step import CachedRequest, ModelRunnerOutput, NewRequest, SchedulerOutput
from ember.worker.encoder_runner import EncoderRunner
from ember.worker.graphs import DecodeGraphs
from ember.worker.logits_pipeline import LogitsPipeline, apply_token_masks
from ember.worker.pooler import Pooler
from ember.worker.sampler import Sampler


@dataclass(slots=True, eq=False)
class RunnerRequest:
    """The runner's own copy of one request (never shared with the scheduler)."""

    request_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what the runner sampled (and was accepted)
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_blocks: int = 0
    # its block ids as a list too: a decode row's cache slot in O(1) Python
    block_ids: list[int] = field(default_factory=list)
    # tokens copied into the batch's token array so far (decode steps read the lists)
    num_written: int = 0
    # tokens proposed for this step (written after the request's tokens)
    draft_token_ids: list[int] = field(default_factory=list)
    adapter_id: int = 0  # the adapter (LoRA) it runs under; 0: the base model
    mm_items: tuple = ()  # its images (ember.multimodal.inputs.MultiModalItem)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows of requests; row ``r``'s tokens are ``token_ids[r, :num_tokens]`` and its
    blocks ``block_table[r, :num_blocks]`` (host arrays)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, min(max_model_len, 1024)), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.requests: dict[str, RunnerRequest] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # A decode step's integers (ids, positions, slots, lengths, offsets) are written
        # into one host array with a single assignment; the tensors are views of it,
        # made once per batch size: no tensor is created on the way to the model.
        self._step = np.zeros(5 * max_num_reqs + 1, dtype=np.int64)
        self._step_ints = memoryview(self._step)  # plain item assignment, no NumPy call
        self._step_tensor = torch.from_numpy(self._step)
        self._step_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._table_tensor = torch.from_numpy(self.block_table)
        self._table_views: dict[tuple[int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def _ensure_width(self, num_tokens: int) -> None:
        width = self.token_ids.shape[1]
        if num_tokens > width:  # doubling: amortized O(1) per token
            grown = np.zeros((self.token_ids.shape[0], min(max(num_tokens, 2 * width), self.max_model_len)),
                             dtype=np.int64)
            grown[:, :width] = self.token_ids
            self.token_ids = grown

    def add(self, new: NewRequest) -> RunnerRequest:
        if new.request_id in self.requests:
            raise ValueError(f"request {new.request_id!r} is already in the runner's batch")
        if not self._free_rows:
            raise RuntimeError("the runner's batch is full (more requests than max_num_seqs)")
        row = self._free_rows.pop()
        request = RunnerRequest(
            new.request_id, row, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
            tuple(new.eos_token_ids), new.num_computed_tokens, adapter_id=new.adapter_id, mm_items=new.mm_items,
        )
        tokens = request.prompt_token_ids + request.output_token_ids
        self._ensure_width(len(tokens))
        self.token_ids[row, : len(tokens)] = tokens
        request.num_written = len(tokens)
        self._add_blocks(request, new.block_ids)
        self.requests[new.request_id] = request
        return request

    def update(self, cached: CachedRequest) -> RunnerRequest:
        request = self.requests[cached.request_id]
        request.num_computed_tokens = cached.num_computed_tokens
        if cached.new_block_ids:
            self._add_blocks(request, cached.new_block_ids)
        return request

    def _add_blocks(self, request: RunnerRequest, block_ids: list[int]) -> None:
        n = len(block_ids)
        if not n:
            return
        end = request.num_blocks + n
        if end > self.block_table.shape[1]:
            raise ValueError(f"request {request.request_id!r} has {end} blocks, more than its context allows")
        self.block_table[request.row, request.num_blocks : end] = block_ids
        request.block_ids.extend(block_ids)
        request.num_blocks = end

    def remove(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._free_rows.append(request.row)

    def _write_tokens(self, request: RunnerRequest) -> None:
        """Copy the request's tokens not in the token array yet (its latest outputs)."""
        end = min(request.num_tokens, self.max_model_len)
        if request.num_written < end:
            self._ensure_width(end)
            first = request.num_written - request.num_prompt_tokens
            self.token_ids[request.row, request.num_written : end] = request.output_token_ids[first : first + end - request.num_written]
            request.num_written = end

    def set_drafts(self, request: RunnerRequest, draft_token_ids: list[int]) -> None:
        """Place proposed tokens after the request's tokens (input ids of this step)."""
        request.draft_token_ids = list(draft_token_ids)
        if draft_token_ids:
            self._write_tokens(request)
            start = request.num_tokens
            self._ensure_width(start + len(draft_token_ids))
            self.token_ids[request.row, start : start + len(draft_token_ids)] = draft_token_ids

    def append(self, request: RunnerRequest, token_ids: list[int]) -> None:
        """Tokens the request emitted this step (accepted drafts and the sampled one)."""
        request.output_token_ids.extend(token_ids)
        request.draft_token_ids = []

    def gather(self, requests: list[RunnerRequest], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """This step's flat input ids and positions (host tensors) and its attention
        batch (slots, block-table rows, lengths on the device), for ``query_lens[i]``
        tokens of ``requests[i]`` from its computed count.

        Right after a forward pass every small operation runs cold (tens of
        microseconds each), so a decode step's integers are written item by item into
        one host array whose views are its tensors (valid until the next step); a
        mixed step's are built with a few NumPy operations and sent as one tensor."""
        bs, n, device = self.block_size, len(requests), self.device
        starts = [r.num_computed_tokens for r in requests]
        width = max(max(r.num_blocks for r in requests), 1)
        rows = None
        if n == 1:  # one row of the table: a view of the host array, made once per (row, width)
            key = (requests[0].row, width)
            tables = self._table_views.get(key)
            if tables is None:
                if len(self._table_views) > 4096:
                    self._table_views.clear()
                tables = self._table_views[key] = self._table_tensor[key[0] : key[0] + 1, :width]
        else:
            rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=n)
            tables = torch.from_numpy(self.block_table[rows, :width])
        if len(query_lens) == sum(query_lens):
            # one token each at position num_computed: a decode's last, or a prompt chunk's (one before an image)
            ints = self._step_ints
            for i, r in enumerate(requests):
                p, prompt = starts[i], r.prompt_token_ids
                ints[i] = prompt[p] if p < len(prompt) else r.output_token_ids[-1]
                ints[n + i] = p
                ints[2 * n + i] = r.block_ids[p // bs] * bs + p % bs
                ints[3 * n + i] = p + 1
                ints[4 * n + i] = i
            ints[5 * n] = n
            views = self._step_views.get(n)
            if views is None:
                views = self._step_views[n] = self._step_tensor[: 5 * n + 1].split([n, n, n, n, n + 1])
            input_ids, positions, slots, seq_lens, query_start_loc = views
            if device.type != "cpu":
                slots, seq_lens, query_start_loc, tables = (
                    slots.to(device), seq_lens.to(device), query_start_loc.to(device), tables.to(device),
                )
            return input_ids, positions, AttentionBatch(
                query_lens, starts, tables, slots, bs, seq_lens, query_start_loc,
            )
        if rows is None:
            rows = np.fromiter((r.row for r in requests), dtype=np.int64, count=n)
        for r in requests:
            self._write_tokens(r)
        lens = np.asarray(query_lens, dtype=np.int64)
        np_starts = np.asarray(starts, dtype=np.int64)
        flat_rows = np.repeat(rows, lens)
        cum = np.cumsum(lens)
        first = cum - lens  # flat index of each request's first token
        np_positions = np.repeat(np_starts, lens) + np.arange(int(cum[-1])) - np.repeat(first, lens)
        slots = self.block_table[flat_rows, np_positions // bs] * bs + np_positions % bs
        step = torch.from_numpy(np.concatenate([
            self.token_ids[flat_rows, np_positions], np_positions, slots, np_starts + lens, first, cum[-1:],
        ]))
        num_tokens = int(cum[-1])
        input_ids, positions, rest = step.split([num_tokens, num_tokens, len(slots) + 2 * n + 1])
        if device.type != "cpu":
            rest, tables = rest.to(device), tables.to(device)
        slots, seq_lens, query_start_loc = rest.split([len(rest) - 2 * n - 1, n, n + 1])
        return input_ids, positions, AttentionBatch(
            query_lens, starts, tables, slots, bs, seq_lens, query_start_loc,
        )


class ModelRunner:
    """Owns the model, the KV cache tensors, the persistent batch and the sampler.

    The KV cache is one tensor per layer, ``(2, num_blocks, block_size, num_kv_heads,
    head_dim)`` in the model's storage dtype, allocated once.
    """

    def __init__(
        self,
        model: BaseCausalLM,
        backend: BaseBackend,
        attention: BaseAttention,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        seed: int | None = None,
        logits_pipeline: LogitsPipeline | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.device = backend.device  # read once: a property on some backends
        self.attention = attention
        self.block_size = block_size
        spec = model.kv_cache_spec
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]
        max_model_len = max_model_len or num_blocks * block_size
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.device)
        self.logits_pipeline = logits_pipeline or LogitsPipeline([])
        self.sampler = Sampler(vocab_size, seed, greedy_op=backend.greedy_op(), pipeline=self.logits_pipeline)
        self._inference_mode = torch.inference_mode()  # not re-entered: execute checks first
        self.graphs: DecodeGraphs | None = None  # decode steps from device graphs (capture_graphs)
        # for speculators that read the target's hidden states (Medusa, EAGLE): each
        # request's hidden state at the position its last emitted token was sampled
        # from, kept when collect_hidden is set
        self.collect_hidden = False
        self.last_hidden: dict[str, torch.Tensor] = {}
        # for EAGLE, whose draft layer attends over every position: the step's hidden
        # states whose input tokens stay, (request id, first position, rows), kept
        # when collect_all_hidden is set
        self.collect_all_hidden = False
        self.step_hidden: list[tuple[str, int, torch.Tensor]] = []
        self.adapter_slots = None  # adapters (LoRA) by slot and each step's runs (ember.worker.adapter_slots)
        self.pooler = Pooler()  # pooling requests' vectors (ember.worker.pooler)
        self.encoder_runner = EncoderRunner(model) if getattr(model, "supports_images", False) else None  # images

    def capture_graphs(self, capture, sizes) -> DecodeGraphs:
        """Capture decode-only forward passes of ``sizes`` requests with the backend's
        ``capture`` (``BaseBackend.graph_capture``); later decode-only steps of up to
        ``max(sizes)`` requests replay them."""
        sizes = [s for s in sizes if s <= self.batch.block_table.shape[0]]  # never more rows than the batch
        with self._inference_mode:
            graphs = DecodeGraphs(
                self.model, self.attention, self.kv_caches, capture, sizes or [1], self.batch.block_table.shape[1],
                self.block_size, self.device,
            )
        self.graphs = None if graphs.is_empty else graphs  # every size refused: eager steps
        return graphs

    def _update_batch(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        for request_id in scheduler_output.finished_request_ids:
            batch.remove(request_id)
            self.last_hidden.pop(request_id, None)
            self.sampler.remove_request(request_id)
            if request_id in self.pooler.active:  # a plain request never calls into the pooler
                self.pooler.remove(request_id)
        for request_id in scheduler_output.preempted_request_ids:
            batch.remove(request_id)  # back as a NewRequest; processors keep their state
            if request_id in self.pooler.active:
                self.pooler.remove(request_id)
        for new in scheduler_output.new_requests:
            batch.add(new)
            if new.sampling_params.pooling is not None:
                self.pooler.add(new.request_id, new.sampling_params.pooling)
        for cached in scheduler_output.cached_requests:
            batch.update(cached)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step in inference mode: the engine's own loops (its thread, its
        process, `LLM.generate`) hold it throughout, so a check suffices; a caller's
        thread enters it for the step, through one reused context (entering a fresh
        `torch.inference_mode()` per step costs tens of microseconds after a forward)."""
        if torch.is_inference_mode_enabled():
            return self._execute(scheduler_output)
        with self._inference_mode:
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(scheduler_output)
        if self.encoder_runner is not None:
            self.encoder_runner.run(scheduler_output, self.batch.requests)
        if self.collect_all_hidden:
            self.step_hidden = []
        if not scheduler_output.num_scheduled_tokens:  # nothing to compute
            return ModelRunnerOutput([], [])
        batch = self.batch
        device = self.device
        drafts = scheduler_output.draft_token_ids
        requests: list[RunnerRequest] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []  # flat rows whose logits are sampled
        rows: list[SamplingRow] = []
        # per request: (first index in sample_rows, number of sampled positions)
        sample_spans: list[tuple[int, int]] = []
        # (index in requests, first flat row, number of rows) of prompt-logprob spans
        prompt_spans: list[tuple[int, int, int]] = []
        num_flat = 0
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = batch.requests[request_id]
            start = request.num_computed_tokens
            if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                # row p predicts token p + 1; the row after the prompt's last token
                # predicts the first generated one, not a prompt token
                num_rows = min(num_tokens, request.num_prompt_tokens - 1 - start)
                prompt_spans.append((len(requests), num_flat, num_rows))
            draft = drafts.get(request_id, ()) if drafts else ()
            if draft or request.draft_token_ids:
                batch.set_drafts(request, draft)
            if request_id in scheduler_output.sampling_request_ids:
                num_positions = len(draft) + 1
                sample_spans.append((len(sample_rows), num_positions))
                first = num_flat + num_tokens - num_positions
                if num_positions == 1:
                    sample_rows.append(first)
                else:
                    sample_rows.extend(range(first, first + num_positions))
                rows.append(SamplingRow(
                    request_id, request.params, request.prompt_token_ids, request.output_token_ids,
                    request.eos_token_ids,
                ))
                if draft:  # a draft position samples as if the drafts before it were accepted
                    rows.extend(
                        SamplingRow(request_id, request.params, request.prompt_token_ids,
                                    request.output_token_ids + list(draft[:j]), request.eos_token_ids)
                        for j in range(1, num_positions)
                    )
            else:
                sample_spans.append((len(sample_rows), 0))
            requests.append(request)
            query_lens.append(num_tokens)
            num_flat += num_tokens
        input_ids, positions, attention_batch = batch.gather(requests, query_lens)
        embeds = self.encoder_runner and self.encoder_runner.input_embeds(input_ids, requests, query_lens, attention_batch)
        graphs = self.graphs if embeds is None else None
        if self.adapter_slots is not None and self.adapter_slots.prepare([r.adapter_id for r in requests], query_lens):
            graphs = None  # adapter tokens a captured graph cannot compute: eager
        if graphs is not None and num_flat == len(requests) <= graphs.max_size:  # one token each: decodes
            hidden = graphs.run(input_ids, positions, attention_batch)
        else:
            metadata = self.attention.prepare(attention_batch)
            if device.type != "cpu":
                input_ids, positions = input_ids.to(device), positions.to(device)
            extra = {} if embeds is None else {"inputs_embeds": embeds}  # image rows in place (EncoderRunner)
            hidden = self.model(input_ids, positions, self.kv_caches, metadata, **extra)
        token_ids: list[int] = []
        logprobs: list[float] = []
        top: list[PositionLogprobs | None] | None = None  # None: no request of the step asks
        if sample_rows:
            if len(sample_rows) == num_flat:  # every row samples (decodes): no gather
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
            if scheduler_output.allowed_token_masks:
                apply_token_masks(logits, scheduler_output.allowed_token_masks, requests, sample_spans)
            sampled = self.sampler(logits, rows)
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
            if any(row.params.logprobs is not None for row in rows):
                top = self.sampler.top_logprobs(sampled.processed, rows, token_ids)
        out_ids: list[list[int]] = []
        out_lps: list[list[float]] = []
        out_top: list[list[PositionLogprobs]] | None = None if top is None else []
        num_accepted: list[int] = []
        for request, (first, num_positions) in zip(requests, sample_spans):
            if not num_positions:
                out_ids.append([])
                out_lps.append([])
                if out_top is not None:
                    out_top.append([])
                num_accepted.append(0)
                continue
            ids = token_ids[first : first + num_positions]
            lps = logprobs[first : first + num_positions]
            accepted = 0
            draft_probs = scheduler_output.draft_probs.get(request.request_id) if scheduler_output.draft_probs else None
            if draft_probs is not None and not request.params.is_greedy:
                # drafts sampled from q: rejection sampling against the target's p
                accepted, ids, lps = self.sampler.verify_drafts(
                    request.draft_token_ids, draft_probs, sampled.processed[first : first + num_positions],
                    rows[first : first + num_positions], ids, lps,
                )
            elif request.draft_token_ids:
                # deterministic drafts (a point mass q): accept while the target's own
                # choice agrees. Exact for greedy; under sampling a draft d is kept with
                # probability p(d) and the first disagreement is a draw from p given
                # "not d", which is rejection sampling's residual for a point mass
                for proposed, chosen in zip(request.draft_token_ids, ids):
                    if proposed != chosen:
                        break
                    accepted += 1
            emit = accepted + 1
            if self.collect_hidden:
                self.last_hidden[request.request_id] = hidden[sample_rows[first + accepted]].clone()
            batch.append(request, ids[:emit])
            out_ids.append(ids[:emit])
            out_lps.append(lps[:emit])
            if out_top is not None:
                out_top.append([t for t in top[first : first + emit] if t is not None] if top[first] is not None else [])
            num_accepted.append(accepted)
        if self.collect_all_hidden:
            self._keep_step_hidden(hidden, requests, query_lens, drafts, num_accepted)
        prompt_logprobs: list[list[PositionLogprobs]] | None = None  # None: no request asks
        if prompt_spans:
            prompt_logprobs = [[] for _ in requests]
            for index, first_row, num_rows in prompt_spans:
                prompt_logprobs[index] = self._prompt_logprobs(hidden, requests[index], first_row, num_rows)
        return ModelRunnerOutput(
            request_ids=[r.request_id for r in requests],
            sampled_token_ids=out_ids,
            sampled_logprobs=out_lps,
            sampled_top_logprobs=out_top,
            prompt_logprobs=prompt_logprobs,
            num_accepted=num_accepted,
            pooled=self.pooler.pool(self.model, hidden, requests, query_lens) if self.pooler.active else None,
        )

    def _keep_step_hidden(
        self, hidden: torch.Tensor, requests: list[RunnerRequest], query_lens: list[int], drafts, num_accepted: list[int],
    ) -> None:
        """Each request's rows of ``hidden`` whose input tokens stay: a whole prefill
        chunk, a decode's last token and its accepted drafts (a rejected draft's row
        is dropped). Copies: a replayed graph reuses its output."""
        first = 0
        for request, num_tokens, accepted in zip(requests, query_lens, num_accepted):
            num_drafts = len(drafts.get(request.request_id, ())) if drafts else 0
            num_kept = num_tokens - num_drafts + accepted
            self.step_hidden.append(
                (request.request_id, request.num_computed_tokens, hidden[first : first + num_kept].clone())
            )
            first += num_tokens

    def _prompt_logprobs(
        self, hidden: torch.Tensor, request: RunnerRequest, first_row: int, num_rows: int, chunk: int = 512
    ) -> list[PositionLogprobs]:
        """Raw log-softmax at the prompt rows of one request, ``chunk`` rows of
        logits at a time (a long prompt's full-vocabulary logits would be large)."""
        num_top = request.params.prompt_logprobs
        out: list[PositionLogprobs] = []
        for offset in range(0, num_rows, chunk):
            n = min(chunk, num_rows - offset)
            logits = self.model.compute_logits(hidden[first_row + offset : first_row + offset + n]).float().cpu()
            start = request.num_computed_tokens + offset + 1
            targets = request.prompt_token_ids[start : start + n]
            out.extend(compute_position_logprobs(logits, targets, [num_top] * n))
        return out

