"""Run one scheduled step: build the flat batch, forward, sample."""

from __future__ import annotations

import torch

from ember.backend import BaseAttention, BaseBackend, SequenceSlice
from ember.logits_pipeline import LogitsPipeline
from ember.logits_processor import SamplingRow
from ember.models.base import BaseCausalLM
from ember.sampler import Sampler
from ember.scheduler import ModelRunnerOutput, SchedulerOutput


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
        self.sampler = Sampler(seed)

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
        for item in scheduled:
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
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
            # The pipeline may change the logits in place: they are this step's own.
            processed = self.logits_pipeline(logits.cpu(), sampling)
            sampled = self.sampler(processed, sampling)
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
        ids_iter, lp_iter = iter(token_ids), iter(logprobs)
        return ModelRunnerOutput(
            request_ids=[item.request_id for item in scheduled],
            sampled_token_ids=[[next(ids_iter)] if item.needs_sample else [] for item in scheduled],
            sampled_logprobs=[[next(lp_iter)] if item.needs_sample else [] for item in scheduled],
        )
