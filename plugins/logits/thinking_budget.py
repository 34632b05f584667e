"""A reasoning model's thinking held to a budget of tokens (Anthropic's
``thinking.budget_tokens``; vLLM calls it a thinking token budget).

A request switches it on with ``SamplingParams.extra["thinking_budget"] = {"budget": N,
"end": "</think>", "start": "<think>"}`` (``start`` only for models that write the
opening tag themselves; ``end_token_ids`` / ``start_token_ids`` may replace the strings).
Once the reasoning has ``budget`` tokens and has not ended, the end tag's tokens are
forced one by one, so the answer that follows comes within the request's ``max_tokens``.
The tags are found as their token sequences (tokenized alone, without special tokens):
exact for models whose tags are single special tokens (Qwen3, DeepSeek-R1).

Stateless per row (it reads the row's own output), so speculative rows and recomputed
requests are handled alike; it does nothing before the budget is reached."""

from __future__ import annotations

from typing import Any

import torch

from ember.plugin import Registry, hookimpl
from ember.plugin.logits_processor import ORDER_TEMPERATURE, BaseLogitsProcessor, SamplingRow
from ember.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _find(tokens: list[int], needle: list[int]) -> bool:
    """Whether ``needle`` occurs in ``tokens`` (its first token searched at C speed)."""
    first, size, start = needle[0], len(needle), 0
    while True:
        try:
            start = tokens.index(first, start)
        except ValueError:
            return False
        if tokens[start: start + size] == needle:
            return True
        start += 1


def _partial(tokens: list[int], needle: list[int]) -> int:
    """The length of the longest end of ``tokens`` that begins ``needle`` (shorter than it)."""
    for size in range(min(len(tokens), len(needle) - 1), 0, -1):
        if tokens[-size:] == needle[:size]:
            return size
    return 0


class ThinkingBudget(BaseLogitsProcessor):
    """Force the end of the reasoning once it has ``budget`` tokens: a forced row keeps
    one finite logit, the end tag's next token, which temperature, the truncations and
    later processors leave the only choice. In the band before temperature, the one
    greedy requests run through too."""

    name = "thinking_budget"
    order = ORDER_TEMPERATURE - 10
    is_argmax_invariant = False

    def __init__(self, context) -> None:
        super().__init__(context)
        self._requests: dict[str, tuple[int, list[int], list[int]]] = {}

    def _ids(self, spec: dict[str, Any], key: str) -> list[int]:
        """The tag ``key`` (``start`` or ``end``) as token ids; [] when not given."""
        ids, text = spec.get(f"{key}_token_ids"), spec.get(key)
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                               and 0 <= i < self.context.vocab_size for i in ids):
                raise ValueError(f"thinking_budget.{key}_token_ids must be a non-empty list of token ids below "
                                 f"{self.context.vocab_size}, got {ids!r}"[:300])
            return ids
        if text is None:
            return []
        if not isinstance(text, str) or not text:
            raise ValueError(f"thinking_budget.{key} must be a non-empty string, got {text!r}"[:300])
        if self.context.tokenizer is None:
            raise ValueError(f"thinking_budget.{key} as text needs the model's tokenizer; give {key}_token_ids")
        return list(self.context.tokenizer.encode(text, add_special_tokens=False))

    def _parse(self, params: SamplingParams) -> tuple[int, list[int], list[int]]:
        spec = params.extra.get(self.name)
        if not isinstance(spec, dict):
            raise ValueError(f'thinking_budget must be an object {{"budget": N, "end": "</think>"}}, got {spec!r}'[:300])
        unknown = set(spec) - {"budget", "start", "end", "start_token_ids", "end_token_ids"}
        if unknown:
            raise ValueError(f"thinking_budget has unknown keys {sorted(unknown)}")
        budget = spec.get("budget")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"thinking_budget.budget must be an integer >= 0, got {budget!r}"[:300])
        end = self._ids(spec, "end")
        if not end:
            raise ValueError("thinking_budget needs the end tag: `end` (text) or `end_token_ids`")
        return budget, self._ids(spec, "start"), end

    def validate(self, params: SamplingParams) -> None:
        self._parse(params)

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = self._parse(params)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            budget, start, end = self._requests[row.request_id]
            body = row.output_token_ids
            if start:  # the model writes the opening tag: no reasoning unless the answer opens with it
                if body[: len(start)] != start or len(body) < len(start):
                    continue
                body = body[len(start):]
            if len(body) < budget or _find(body, end):
                continue
            forced = end[_partial(body, end)]
            logits[i].fill_(NEG_INF)
            logits[i, forced] = 0.0
        return logits


@hookimpl
def ember_register_logits_processors(registry: Registry) -> None:
    registry.register(ThinkingBudget.name, ThinkingBudget)
