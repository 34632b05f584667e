"""Penalties on tokens already seen, with per-request state kept incrementally: each
request's set (or counts) of seen tokens is built once from its prompt when it joins
and grows by the tokens generated since the last step, so a step costs
O(new tokens), not O(sequence length)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.logits_processor import ORDER_ADJUST, BaseLogitsProcessor, SamplingRow
from ember.plugin import Registry, hookimpl
from ember.sampling_params import SamplingParams


@dataclass(slots=True)
class _Seen:
    """Per-request token statistics over the vocabulary, and how many output tokens
    they include so far."""

    table: torch.Tensor  # (vocab,)
    num_outputs_seen: int = 0


class _SeenTokensProcessor(BaseLogitsProcessor):
    """Shared bookkeeping: ``_update`` brings each row's table up to date."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self._state: dict[str, _Seen] = {}

    def remove_request(self, request_id: str) -> None:
        del self._state[request_id]

    def _tables(self, rows: list[SamplingRow]) -> torch.Tensor:
        """``(len(rows), vocab)``: every row's table, after adding its new output tokens."""
        vocab = self.context.vocab_size
        for row in rows:
            state = self._state[row.request_id]
            new = row.output_token_ids[state.num_outputs_seen :]
            if new:
                ids = torch.tensor([t for t in new if t < vocab], dtype=torch.int64)
                state.table.index_put_((ids,), torch.ones_like(ids, dtype=state.table.dtype), accumulate=True)
                state.num_outputs_seen += len(new)
        return torch.stack([self._state[row.request_id].table for row in rows])


class RepetitionPenalty(_SeenTokensProcessor):
    """transformers' ``RepetitionPenaltyLogitsProcessor`` (CTRL, Keskar et al. 2019):
    for every token in the prompt or the output so far, a positive logit is divided
    by ``repetition_penalty`` and a negative one multiplied by it."""

    name = "repetition_penalty"
    order = ORDER_ADJUST + 20

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        vocab = self.context.vocab_size
        table = torch.zeros(vocab, dtype=torch.float32)
        table[torch.tensor([t for t in prompt_token_ids if t < vocab], dtype=torch.int64)] = 1.0
        self._state[request_id] = _Seen(table)

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        seen = self._tables(rows).to(logits.device) > 0
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype, device=logits.device)[:, None]
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        return torch.where(seen, penalized, logits)


class FrequencyPresencePenalty(_SeenTokensProcessor):
    """OpenAI's penalties over the output tokens (not the prompt):
    ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``."""

    name = "frequency_presence_penalty"
    order = ORDER_ADJUST + 30

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._state[request_id] = _Seen(torch.zeros(self.context.vocab_size, dtype=torch.float32))

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        counts = self._tables(rows).to(logits.device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype, device=logits.device)
        presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype, device=logits.device)
        return logits.sub_(frequency[:, None] * counts + presence[:, None] * (counts > 0))


PROCESSORS = (RepetitionPenalty, FrequencyPresencePenalty)


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    for cls in PROCESSORS:
        registry.register(cls.name, cls)
