"""A third-party logits processor: ``ban_digits`` keeps digits out of a request's text.

Switched on per request through ``SamplingParams.extra`` (``extra={"ban_digits": true}``
offline, ``"extra": {"ban_digits": true}`` on the HTTP routes). The value is the
request's parameters: ``true`` bans every token whose text holds a digit; a string
of digits (``"13579"``) bans only the tokens holding one of those.
"""

from __future__ import annotations

import torch

from ember.logits_processor import BaseLogitsProcessor, LogitsProcessorContext, SamplingRow
from ember.sampling_params import SamplingParams

ALL_DIGITS = "0123456789"


class BanDigits(BaseLogitsProcessor):
    name = "ban_digits"
    # order: the default (with the other adjustments, before temperature and truncation)
    # is_argmax_invariant: False (it changes which token is most likely)

    def __init__(self, context: LogitsProcessorContext) -> None:
        super().__init__(context)
        self._token_texts: list[str] | None = None  # decoded on first use, not at startup
        self._masks: dict[str, torch.Tensor] = {}  # digits -> (vocab,) bool, shared by requests
        self._digits_of: dict[str, str] = {}  # request id -> the digits it bans

    @staticmethod
    def _digits(params: SamplingParams) -> str:
        value = params.extra["ban_digits"]
        return ALL_DIGITS if value is True else value

    def validate(self, params: SamplingParams) -> None:
        value = params.extra["ban_digits"]
        if not (value is True or (isinstance(value, str) and value and all(c in ALL_DIGITS for c in value))):
            raise ValueError(f"extra['ban_digits'] must be true or a string of digits, got {value!r}")
        if self.context.tokenizer is None:
            raise ValueError("extra['ban_digits'] needs the model's tokenizer")

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        digits = self._digits(params)
        if digits not in self._masks:
            self._masks[digits] = self._mask(digits)
        self._digits_of[request_id] = digits

    def remove_request(self, request_id: str) -> None:
        del self._digits_of[request_id]

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        masks = torch.stack([self._masks[self._digits_of[row.request_id]] for row in rows])
        return logits.masked_fill_(masks.to(logits.device), float("-inf"))

    def _mask(self, digits: str) -> torch.Tensor:
        if self._token_texts is None:
            tokenizer = self.context.tokenizer
            num_tokens = min(len(tokenizer), self.context.vocab_size)
            self._token_texts = tokenizer.batch_decode([[i] for i in range(num_tokens)])
        mask = torch.zeros(self.context.vocab_size, dtype=torch.bool)
        banned = [i for i, text in enumerate(self._token_texts) if any(c in digits for c in text)]
        mask[banned] = True
        return mask
