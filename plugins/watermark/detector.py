"""Detect the watermark: count green tokens and test against chance.

Each token after the first is scored: green under the list its predecessor seeds,
or not. Without a watermark a token is green with probability ``gamma``, so over
``T`` scored tokens with ``G`` green ones

    z = (G - gamma T) / sqrt(T gamma (1 - gamma))

is about standard normal; the p-value is the one-sided normal tail
``P(Z >= z) = erfc(z / sqrt 2) / 2``. Kirchenbauer et al. call ``z > 4`` detected
(a false positive rate of 3e-5).

By default a repeated ``(previous, token)`` pair is scored once (the paper's
"ignore repeated n-grams", with n = 2): text that repeats a phrase would otherwise
count the same coin flip many times, inflating ``|z|`` of unwatermarked text too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .green_list import GreenList

DEFAULT_Z_THRESHOLD = 4.0


@dataclass(frozen=True)
class DetectionOutput:
    num_tokens_scored: int
    num_green_tokens: int
    green_fraction: float
    z_score: float
    p_value: float
    gamma: float
    z_threshold: float
    is_watermarked: bool

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def z_score(num_green: int, num_scored: int, gamma: float) -> float:
    return (num_green - gamma * num_scored) / math.sqrt(num_scored * gamma * (1.0 - gamma))


def p_value(z: float) -> float:
    """One-sided: the chance that unwatermarked text scores at least ``z``."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


class Detector:
    """Scores token ids (or text, with ``tokenizer``) against one green list."""

    def __init__(
        self, green_list: GreenList, tokenizer: Any = None, z_threshold: float = DEFAULT_Z_THRESHOLD,
        ignore_repeated_bigrams: bool = True,
    ) -> None:
        self.green_list = green_list
        self.tokenizer = tokenizer
        self.z_threshold = z_threshold
        self.ignore_repeated_bigrams = ignore_repeated_bigrams

    def detect(self, token_ids: Sequence[int], prefix_token_id: int | None = None) -> DetectionOutput:
        """``token_ids``: the generated tokens. ``prefix_token_id``: the token before
        them (the prompt's last) if known, so that the first one is scored too."""
        ids = list(token_ids)
        vocab = self.green_list.vocab_size
        for t in ids if prefix_token_id is None else [prefix_token_id, *ids]:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if prefix_token_id is not None:
            ids = [prefix_token_id, *ids]
        if len(ids) < 2:
            raise ValueError("need at least 2 tokens to score a watermark (the first only seeds the second)")
        pairs = list(zip(ids, ids[1:]))
        if self.ignore_repeated_bigrams:
            pairs = list(dict.fromkeys(pairs))
        num_scored = len(pairs)
        num_green = sum(self.green_list.is_green(prev, t) for prev, t in pairs)
        gamma = self.green_list.gamma
        z = z_score(num_green, num_scored, gamma)
        return DetectionOutput(
            num_tokens_scored=num_scored,
            num_green_tokens=num_green,
            green_fraction=num_green / num_scored,
            z_score=z,
            p_value=p_value(z),
            gamma=gamma,
            z_threshold=self.z_threshold,
            is_watermarked=z > self.z_threshold,
        )

    def detect_text(self, text: str) -> DetectionOutput:
        """Tokenize ``text`` without special tokens and score it. Re-tokenizing may
        not give back the exact generated ids; the score is robust to a few."""
        if self.tokenizer is None:
            raise ValueError("this detector has no tokenizer; pass token ids")
        return self.detect(self.tokenizer.encode(text, add_special_tokens=False))
