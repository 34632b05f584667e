"""Biases and bans: logit_bias (OpenAI), bad words (transformers'
``NoBadWordsLogitsProcessor``: single tokens and multi-token sequences), and
min_tokens (transformers' ``MinNewTokensLengthLogitsProcessor`` over EOS and the
request's stop token ids)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.logits_processor import ORDER_ADJUST, BaseLogitsProcessor, SamplingRow
from ember.plugin import Registry, hookimpl
from ember.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _check_ids(ids, vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside the vocabulary [0, {vocab_size})")


class LogitBias(BaseLogitsProcessor):
    """``logit[t] += logit_bias[t]`` (OpenAI; a bias of -100 in effect bans a token)."""

    name = "logit_bias"
    order = ORDER_ADJUST + 10

    def __init__(self, context) -> None:
        super().__init__(context)
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def validate(self, params: SamplingParams) -> None:
        _check_ids(params.logit_bias, self.context.vocab_size, "logit_bias")

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self._biases[request_id] = (ids, values)

    def remove_request(self, request_id: str) -> None:
        del self._biases[request_id]

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            ids, values = self._biases[row.request_id]
            logits[i].index_add_(0, ids.to(logits.device), values.to(logits.device, logits.dtype))
        return logits


@dataclass(frozen=True, slots=True)
class _BadWords:
    single: torch.Tensor  # token ids banned at every step
    sequences: tuple[tuple[tuple[int, ...], int], ...]  # (prefix, last token): ban last after prefix


class BadWords(BaseLogitsProcessor):
    """Never generate any of ``bad_words_token_ids``: a one-token sequence bans that
    token; a longer one bans its last token whenever the tokens so far (prompt and
    output, as transformers matches ``input_ids``) end with the rest of it."""

    name = "bad_words"
    order = ORDER_ADJUST + 40

    def __init__(self, context) -> None:
        super().__init__(context)
        self._words: dict[str, _BadWords] = {}

    def validate(self, params: SamplingParams) -> None:
        for word in params.bad_words_token_ids:
            _check_ids(word, self.context.vocab_size, "bad_words_token_ids")

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        single = sorted({w[0] for w in params.bad_words_token_ids if len(w) == 1})
        sequences = tuple((w[:-1], w[-1]) for w in params.bad_words_token_ids if len(w) > 1)
        self._words[request_id] = _BadWords(torch.tensor(single, dtype=torch.int64), sequences)

    def remove_request(self, request_id: str) -> None:
        del self._words[request_id]

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            words = self._words[row.request_id]
            banned = [last for prefix, last in words.sequences if _ends_with(row, prefix)]
            if words.single.numel():
                logits[i, words.single.to(logits.device)] = NEG_INF
            if banned:
                logits[i, torch.tensor(banned, dtype=torch.int64, device=logits.device)] = NEG_INF
        return logits


def _ends_with(row: SamplingRow, prefix: tuple[int, ...]) -> bool:
    """Do the prompt and output tokens, joined, end with ``prefix``? (No copy of either.)"""
    output, prompt, n = row.output_token_ids, row.prompt_token_ids, len(prefix)
    if n <= len(output):
        return tuple(output[len(output) - n :]) == prefix
    from_prompt = n - len(output)
    if from_prompt > len(prompt):
        return False
    return tuple(prompt[len(prompt) - from_prompt :]) + tuple(output) == prefix


class MinTokens(BaseLogitsProcessor):
    """Until ``min_tokens`` tokens were generated, EOS (unless ``ignore_eos``) and the
    request's ``stop_token_ids`` cannot be sampled."""

    name = "min_tokens"
    order = ORDER_ADJUST + 50

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if row.num_output_tokens >= params.min_tokens:
                continue
            ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                ids.update(row.eos_token_ids)
            ids = sorted(t for t in ids if t < vocab)
            banned_rows.extend([i] * len(ids))
            banned_ids.extend(ids)
        if banned_rows:
            logits[banned_rows, banned_ids] = NEG_INF
        return logits


PROCESSORS = (LogitBias, BadWords, MinTokens)


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    for cls in PROCESSORS:
        registry.register(cls.name, cls)
