"""Run one scheduled step: update the persistent batch from the step's deltas, gather
the flat batch, forward, mask, sample and verify drafts.

The runner shares no mutable state with the scheduler: it reads an
`ember.step.SchedulerOutput` and returns an `ember.step.ModelRunnerOutput`, keeping
its own copy of every request in an :class:`ember.input_batch.InputBatch`.
"""

from __future__ import annotations

import torch

from ember.backend import BaseAttention, BaseBackend
from ember.input_batch import InputBatch, RunnerRequest
from ember.logits_processor import LogitsPipeline, SamplingRow
from ember.logprobs import PositionLogprobs, compute_position_logprobs
from ember.models.base import BaseCausalLM
from ember.sampler import Sampler
from ember.step import ModelRunnerOutput, SchedulerOutput


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
        self.attention = attention
        self.block_size = block_size
        spec = model.kv_cache_spec
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype, device=backend.device)
            for _ in range(spec.num_layers)
        ]
        max_model_len = max_model_len or num_blocks * block_size
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, backend.device)
        self.logits_pipeline = logits_pipeline or LogitsPipeline([])
        self.sampler = Sampler(vocab_size, seed, greedy_op=backend.greedy_op(), pipeline=self.logits_pipeline)

    def _update_batch(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        for request_id in scheduler_output.finished_request_ids:
            batch.remove(request_id)
            self.sampler.remove_request(request_id)
        for request_id in scheduler_output.preempted_request_ids:
            batch.remove(request_id)  # back as a NewRequest; processors keep their state
        for new in scheduler_output.new_requests:
            batch.add(new)
        for cached in scheduler_output.cached_requests:
            batch.update(cached)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [])
        batch = self.batch
        device = self.backend.device
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
        metadata = self.attention.prepare(attention_batch)
        if device.type != "cpu":
            input_ids, positions = input_ids.to(device), positions.to(device)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        token_ids: list[int] = []
        logprobs: list[float] = []
        top: list[PositionLogprobs | None] = []
        if sample_rows:
            if len(sample_rows) == num_flat:  # every row samples (decodes): no gather
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
            if scheduler_output.allowed_token_masks:
                self._apply_masks(logits, scheduler_output, requests, sample_spans)
            sampled = self.sampler(logits, rows)
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
            if any(row.params.logprobs is not None for row in rows):
                top = self._top_logprobs(sampled.processed, rows, token_ids)
            else:
                top = [None] * len(rows)
        out_ids: list[list[int]] = []
        out_lps: list[list[float]] = []
        out_top: list[list[PositionLogprobs]] = []
        num_accepted: list[int] = []
        for request, (first, num_positions) in zip(requests, sample_spans):
            if not num_positions:
                out_ids.append([])
                out_lps.append([])
                out_top.append([])
                num_accepted.append(0)
                continue
            ids = token_ids[first : first + num_positions]
            # accept drafts while the target model's own choice agrees: each emitted
            # token is the target's sample given the tokens before it (exact for
            # greedy; under sampling every emitted token is still the target's draw)
            accepted = 0
            if request.draft_token_ids:
                for proposed, chosen in zip(request.draft_token_ids, ids):
                    if proposed != chosen:
                        break
                    accepted += 1
            emit = accepted + 1
            batch.append(request, ids[:emit])
            out_ids.append(ids[:emit])
            out_lps.append(logprobs[first : first + emit])
            out_top.append([t for t in top[first : first + emit] if t is not None] if top[first] is not None else [])
            num_accepted.append(accepted)
        prompt_logprobs: list[list[PositionLogprobs]] = [[] for _ in requests]
        for index, first_row, num_rows in prompt_spans:
            prompt_logprobs[index] = self._prompt_logprobs(hidden, requests[index], first_row, num_rows)
        return ModelRunnerOutput(
            request_ids=[r.request_id for r in requests],
            sampled_token_ids=out_ids,
            sampled_logprobs=out_lps,
            sampled_top_logprobs=out_top,
            prompt_logprobs=prompt_logprobs,
            num_accepted=num_accepted,
        )

    @staticmethod
    def _apply_masks(
        logits: torch.Tensor, scheduler_output: SchedulerOutput, requests: list[RunnerRequest],
        sample_spans: list[tuple[int, int]],
    ) -> None:
        """Ban, in place, the tokens each request's allowed-token mask leaves out."""
        masks = scheduler_output.allowed_token_masks
        if not masks:
            return
        for request, (first, num_positions) in zip(requests, sample_spans):
            mask = masks.get(request.request_id)
            if mask is None or not num_positions:
                continue
            if mask.dtype != torch.bool or mask.shape[-1] != logits.shape[-1] or mask.shape[0] < num_positions:
                raise ValueError(
                    f"allowed-token mask of {request.request_id!r} must be bool (positions >= {num_positions}, "
                    f"{logits.shape[-1]}), got {mask.dtype} {tuple(mask.shape)}"
                )
            logits[first : first + num_positions].masked_fill_(~mask[:num_positions].to(logits.device), float("-inf"))

    @staticmethod
    def _top_logprobs(
        processed: torch.Tensor, sampling: list[SamplingRow], token_ids: list[int]
    ) -> list[PositionLogprobs | None]:
        """Rank and top-N of the sampled tokens, for the rows that ask only."""
        asking = [i for i, row in enumerate(sampling) if row.params.logprobs is not None]
        out: list[PositionLogprobs | None] = [None] * len(sampling)
        if asking:
            index = torch.tensor(asking, dtype=torch.int64, device=processed.device)
            entries = compute_position_logprobs(
                processed.index_select(0, index).float().cpu(), [token_ids[i] for i in asking],
                [sampling[i].params.logprobs for i in asking],
            )
            for i, entry in zip(asking, entries):
                out[i] = entry
        return out

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

