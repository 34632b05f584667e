"""Run one scheduled step: build the flat batch, forward, sample."""

from __future__ import annotations

import torch

from ember.backend import BaseAttention, BaseBackend, SequenceSlice
from ember.logits_pipeline import LogitsPipeline
from ember.logits_processor import SamplingRow
from ember.logprobs import PositionLogprobs, compute_position_logprobs
from ember.models.base import BaseCausalLM
from ember.sampler import Sampler
from ember.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


class ModelRunner:
    """Owns the model, the KV cache tensors, the logits pipeline and the sampler.

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
        self.logits_pipeline = logits_pipeline or LogitsPipeline([])
        self.sampler = Sampler(seed, greedy_op=backend.greedy_op())

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.sampler.free(request_id)
            self.logits_pipeline.remove_request(request_id)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput([], [])
        device = self.backend.device
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sampling: list[SamplingRow] = []
        # (index in `scheduled`, first flat row, number of rows) of prompt-logprob spans
        prompt_spans: list[tuple[int, int, int]] = []
        for index, item in enumerate(scheduled):
            if item.is_prefill and item.request.sampling_params.prompt_logprobs is not None:
                # row p predicts token p + 1; the row after the prompt's last token
                # predicts the first generated one, not a prompt token
                num_rows = min(item.num_tokens, item.request.num_prompt_tokens - 1 - item.start_position)
                if num_rows > 0:
                    prompt_spans.append((index, len(input_ids), num_rows))
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + item.num_tokens))
            slices.append(SequenceSlice(item.num_tokens, item.start_position, item.block_table))
            if item.needs_sample:
                request = item.request
                sample_rows.append(len(input_ids) - 1)
                sampling.append(
                    SamplingRow(
                        request.request_id, request.sampling_params, request.prompt_token_ids,
                        request.output_token_ids, request.eos_token_ids,
                    )
                )
        metadata = self.attention.prepare(slices, self.block_size, device)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_caches,
            metadata,
        )
        token_ids: list[int] = []
        logprobs: list[float] = []
        top: list[PositionLogprobs | None] = []
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
            # The pipeline may change the logits in place: they are this step's own.
            processed = self.logits_pipeline(logits.cpu(), sampling)
            sampled = self.sampler(processed, sampling)
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
            top = self._top_logprobs(processed, sampling, token_ids)
        ids_iter, lp_iter, top_iter = iter(token_ids), iter(logprobs), iter(top)
        sampled_top: list[list[PositionLogprobs]] = []
        for item in scheduled:
            entry = next(top_iter) if item.needs_sample else None
            sampled_top.append([entry] if entry is not None else [])
        prompt_logprobs: list[list[PositionLogprobs]] = [[] for _ in scheduled]
        for index, first_row, num_rows in prompt_spans:
            prompt_logprobs[index] = self._prompt_logprobs(hidden, scheduled[index], first_row, num_rows)
        return ModelRunnerOutput(
            request_ids=[item.request_id for item in scheduled],
            sampled_token_ids=[[next(ids_iter)] if item.needs_sample else [] for item in scheduled],
            sampled_logprobs=[[next(lp_iter)] if item.needs_sample else [] for item in scheduled],
            sampled_top_logprobs=sampled_top,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _top_logprobs(
        processed: torch.Tensor, sampling: list[SamplingRow], token_ids: list[int]
    ) -> list[PositionLogprobs | None]:
        """Rank and top-N of the sampled tokens, for the rows that ask only."""
        asking = [i for i, row in enumerate(sampling) if row.params.logprobs is not None]
        out: list[PositionLogprobs | None] = [None] * len(sampling)
        if asking:
            index = torch.tensor(asking, dtype=torch.int64)
            entries = compute_position_logprobs(
                processed.index_select(0, index), [token_ids[i] for i in asking],
                [sampling[i].params.logprobs for i in asking],
            )
            for i, entry in zip(asking, entries):
                out[i] = entry
        return out

    def _prompt_logprobs(
        self, hidden: torch.Tensor, item: ScheduledRequest, first_row: int, num_rows: int, chunk: int = 512
    ) -> list[PositionLogprobs]:
        """Raw log-softmax at the prompt rows of one request, ``chunk`` rows of
        logits at a time (a long prompt's full-vocabulary logits would be large)."""
        request = item.request
        num_top = request.sampling_params.prompt_logprobs
        out: list[PositionLogprobs] = []
        for offset in range(0, num_rows, chunk):
            n = min(chunk, num_rows - offset)
            logits = self.model.compute_logits(hidden[first_row + offset : first_row + offset + n]).float().cpu()
            start = item.start_position + offset + 1
            targets = request.prompt_token_ids[start : start + n]
            out.extend(compute_position_logprobs(logits, targets, [num_top] * n))
        return out
