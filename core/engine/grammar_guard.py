"""One constrained request's guard around its grammar matcher: the budget that makes the
output close, the bound on repetition, and the reasoning left free before the grammar.

The grammar manager keeps one :class:`GuardedMatcher` per running constrained request and
calls it as it would the backend's matcher (fill, accept, roll back). On top of the
matcher it adds, each optional (docs/grammar.md):

* **Budget** (`GuardSettings.budget`): the tokens the request may still emit (its
  ``max_tokens`` and the context left, less what it emitted) go to a matcher that
  `supports_budget`, which keeps only tokens after which the output can still end
  validly in time; so a constrained output closes whenever ``max_tokens`` allows it.
* **Repetition bound** (`GuardSettings.repetition_limit`, 0: off): once the output ends
  in a run of at least that many tokens (and two whole periods) repeating with a period
  of up to `MAX_PERIOD` tokens, and the repeating unit holds no JSON punctuation (so
  strings, numbers and whitespace, not arrays of equal items), the token that would go
  on repeating is masked. It is never the last token allowed: the grammar's other
  tokens (the closing quote among them) stay, so no valid completion is lost.
* **Reasoning first** (`SamplingParams.grammar_after`, a `ReasoningSpan`): the output
  is free until the reasoning's end tag, and the matcher starts at the token after it.
  When the output may open with the reasoning's start tag, the first tokens may also be
  those that spell it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ember.plugin.grammar import BaseGrammarMatcher, clear_tokens, is_allowed, set_tokens
from ember.sampling_params import ReasoningSpan

MAX_PERIOD = 16
# bytes a repeating unit must not hold for the bound to apply: JSON's structure
_PUNCTUATION = frozenset(b'"{}[],:')


@dataclass(frozen=True)
class GuardSettings:
    budget: bool = True
    repetition_limit: int = 12


class Vocab:
    """What the guards of one engine share: the tokens' bytes and the masks built from them."""

    def __init__(self, token_bytes: list[bytes | None], eos_token_ids: tuple[int, ...], num_words: int) -> None:
        self.token_bytes = token_bytes
        self.eos_token_ids = eos_token_ids
        free = [i for i, data in enumerate(token_bytes) if data is not None] + list(eos_token_ids)
        self.free_row = _row(free, num_words)  # every token a model may write: reasoning is not constrained
        self.num_words = num_words
        self._opening: dict[tuple[str, bytes], np.ndarray] = {}
        self._structural = np.array([data is None or bool(_PUNCTUATION & set(data)) for data in token_bytes])

    def opening_row(self, tag: str, written: bytes) -> np.ndarray:
        """The tokens that, after ``written`` (a prefix of ``tag``), spell more of ``tag`` or all of it."""
        key = (tag, written)
        row = self._opening.get(key)
        if row is None:
            want = tag.encode()[len(written):]
            ids = [i for i, data in enumerate(self.token_bytes)
                   if data and (want.startswith(data) or data.startswith(want))]
            row = self._opening[key] = _row(ids, self.num_words)
        return row

    def is_structural(self, token_id: int) -> bool:
        return token_id >= len(self._structural) or bool(self._structural[token_id])


def _row(ids: Sequence[int], num_words: int) -> np.ndarray:
    words = np.zeros(num_words, dtype=np.uint32)
    ids = np.asarray(ids, dtype=np.int64)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
    return words


def repeating_token(history: Sequence[int], limit: int, vocab: Vocab) -> int | None:
    """The token that would extend a run at the end of ``history`` repeating with a
    period of at most `MAX_PERIOD`, at least ``limit`` tokens long and two periods, of a
    unit without JSON punctuation; None when there is no such run."""
    n = len(history)
    if limit <= 0 or n < limit:
        return None
    for period in range(1, min(MAX_PERIOD, n // 2) + 1):
        run = period
        while run < n and history[n - 1 - run] == history[n - 1 - run + period]:
            run += 1
        if run >= max(limit, 2 * period):
            unit = history[n - period:]
            if not any(vocab.is_structural(t) for t in unit):
                return history[n - period]
    return None


class GuardedMatcher:
    """A request's matcher with its budget, repetition bound and reasoning span."""

    def __init__(
        self, matcher: BaseGrammarMatcher, max_tokens: int, settings: GuardSettings, vocab: Vocab,
        span: ReasoningSpan | None = None,
    ) -> None:
        self.matcher = matcher
        self.max_tokens = max_tokens
        self.settings = settings
        self.vocab = vocab
        self.span = span
        self.num_tokens = 0  # accepted so far, reasoning included (the budget counts them all)
        self.history: list[int] = []  # the tokens the matcher accepted
        # "grammar", or before it "opening" (may still spell the start tag) or "reasoning"
        self.phase = "grammar"
        self.text = b""  # the start tag spelt so far, or the reasoning's tail (to find the end tag)
        self._log: list[tuple[str, bytes]] = []  # per token outside the grammar: phase and text before it
        self._opened_by_answer = False  # the grammar began at a token that could have opened the reasoning
        if span is not None:
            self.phase = "reasoning" if span.starts_inside else ("opening" if span.start_tag else "grammar")

    # -- masks ---------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row].numpy().view(np.uint32)
        if self.phase == "reasoning":
            words[:] = self.vocab.free_row
            return
        if self.phase == "opening":
            if self.text:
                words[:] = self.vocab.opening_row(self.span.start_tag, self.text)
                return
            self._fill_grammar(bitmask, row)
            words |= self.vocab.opening_row(self.span.start_tag, b"")
            return
        self._fill_grammar(bitmask, row)
        self._bound_repetition(bitmask, row)

    def _fill_grammar(self, bitmask: torch.Tensor, row: int) -> None:
        matcher = self.matcher
        if self.settings.budget and matcher.supports_budget:
            matcher.fill_bitmask_within(bitmask, row, self.max_tokens - self.num_tokens)
        else:
            matcher.fill_bitmask(bitmask, row)

    def _bound_repetition(self, bitmask: torch.Tensor, row: int) -> None:
        token = repeating_token(self.history, self.settings.repetition_limit, self.vocab)
        if token is None or not is_allowed(bitmask[row], token):
            return
        target = bitmask[row]
        clear_tokens(target, (token,))
        if not target.any():  # the only token the grammar allows: it stays
            set_tokens(target, (token,))

    # -- following the output --------------------------------------------------------
    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        for num, token_id in enumerate(token_ids):
            if self.phase == "grammar":
                if self.matcher.accept_tokens((token_id,)) != 1:
                    return num
                self.history.append(token_id)
            elif not self._accept_free(token_id):
                return num
            self.num_tokens += 1
        return len(token_ids)

    def _accept_free(self, token_id: int) -> bool:
        """A token before the grammar (opening or reasoning); False if not allowed there."""
        data = self.vocab.token_bytes[token_id] if token_id < len(self.vocab.token_bytes) else None
        before = (self.phase, self.text)
        if self.phase == "opening":
            tag = self.span.start_tag.encode()
            spelt = self.text + (data or b"")
            if data and spelt.startswith(tag):
                self.phase, self.text = "reasoning", spelt[len(tag):]
            elif data and tag.startswith(spelt):
                self.text = spelt
            elif self.text:
                return False  # half a start tag, then something else
            else:  # no reasoning: the answer, under the grammar, from this token
                if self.matcher.accept_tokens((token_id,)) != 1:
                    return False
                self.phase, self._opened_by_answer = "grammar", True
                self.history.append(token_id)
                return True
        elif token_id not in self.vocab.eos_token_ids:  # reasoning: free until the end tag
            tag = self.span.end_tag.encode()
            text = self.text + (data or b"")
            if tag in text:
                self.phase, self.text = "grammar", b""  # what follows the tag in this token is not constrained
            else:
                self.text = text[-(len(tag) - 1):] if len(tag) > 1 else b""
        self._log.append(before)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Tokens are the free ones (`_log`), then those the matcher followed (`history`)."""
        for _ in range(num_tokens):
            self.num_tokens -= 1
            if self.history:
                self.matcher.rollback(1)
                self.history.pop()
                if not self.history and self._opened_by_answer:
                    self.phase, self.text, self._opened_by_answer = "opening", b"", False
            else:
                self.phase, self.text = self._log.pop()

    @property
    def is_finished(self) -> bool:
        return self.phase == "grammar" and self.matcher.is_finished
