"""A way to end a constrained output, found by a bounded greedy walk: the budget of a
backend that cannot measure distances (xgrammar's pushdown automaton).

From the matcher's position the walk takes, at each step, the allowed token that best
closes: EOS where allowed; else a token made only of ``"``, ``}``, ``]`` and ``0``, those
opening with ``"`` first (a string closed: inside one, ``]]`` is text), then with ``}`` or
``]`` (an object or array closed), then ``0`` (a number), longer first; else the shortest allowed
token (a forced key, an enum value, a pattern's characters, the rest of a character whose
first bytes were written: a longer token could begin another). It stops at an end, or
gives up after `MAX_PATH` tokens; then it rolls the matcher back. The walk is
deterministic, so from each token of a path the walk from the next position is the
rest of that path: a request made to follow it reaches the end in exactly its length.

The path is a way to end, not always the shortest (outlines' index gives that):
`ClosingMatcher` forces it once the tokens left are within `MARGIN` of its length, and a
single token that lengthens it by more than `MARGIN` (opening a large object) can still
leave an output cut at ``max_tokens``.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_PATH = 64
MARGIN = 8
LOOKAHEAD = 96  # no walk while more tokens than this are left
_CLOSERS = frozenset(b'"}]0')


class ClosingVocab:
    """Per token: whether it only closes, and its length, for the walk's choices."""

    def __init__(self, token_bytes: list[bytes | None], eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        lengths = np.array([len(data) if data else 0 for data in token_bytes], dtype=np.int64)
        closes = np.array([bool(data) and set(data) <= _CLOSERS for data in token_bytes])
        # the walk's preference: closers by tier (longer first), then shorter tokens, then lower ids
        tier = np.array([3 if data[:1] == b'"' else 2 if data[:1] in (b"}", b"]") else 1
                         for data in (d or b"" for d in token_bytes)])
        score = np.where(closes, (tier << 20) + lengths, -lengths)
        self.order = np.lexsort((np.arange(len(score)), -score))
        self.rank = np.empty_like(self.order)
        self.rank[self.order] = np.arange(len(self.order))

    def choose(self, row: torch.Tensor) -> int | None:
        """The token the walk takes among those ``row`` allows (EOS first)."""
        bits = np.unpackbits(row.numpy().view(np.uint8), count=self.vocab_size, bitorder="little").astype(bool)
        for eos in self.eos_token_ids:
            if bits[eos]:
                return eos
        allowed = np.flatnonzero(bits[: len(self.rank)])
        return None if allowed.size == 0 else int(allowed[np.argmin(self.rank[allowed])])


def closing_path(matcher, vocab: ClosingVocab, scratch: torch.Tensor) -> list[int] | None:
    """The walk's tokens from ``matcher``'s position to an end (ending in EOS, or where
    the matcher is finished), None past `MAX_PATH`. ``matcher`` is the backend's own
    (fill_bitmask, accept_tokens, rollback, is_finished); it is left where it was."""
    path: list[int] = []
    try:
        while len(path) <= MAX_PATH:
            if matcher.is_finished:
                return path
            matcher.fill_bitmask(scratch, 0)
            token = vocab.choose(scratch[0])
            if token is None or matcher.accept_tokens((token,)) != 1:
                return None
            path.append(token)
            if token in vocab.eos_token_ids:
                return path
        return None
    finally:
        if path:
            matcher.rollback(len(path))


class ClosingMatcher:
    """The budget methods of a matcher whose backend has no distances: a mixin over the
    backend's matcher (needs ``_closing_vocab`` and the matcher methods)."""

    supports_budget = True
    _closing_vocab: ClosingVocab
    _closing_scratch: torch.Tensor | None = None

    def _path(self) -> list[int] | None:
        if self._closing_scratch is None:
            self._closing_scratch = torch.empty((1, (self._closing_vocab.vocab_size + 31) // 32), dtype=torch.int32)
        return closing_path(self, self._closing_vocab, self._closing_scratch)

    def min_tokens_to_end(self) -> int | None:
        path = self._path()
        if path is None:
            return None
        # a path ending where the matcher is finished (no EOS) counts the stop as one token
        return len(path) if path and path[-1] in self._closing_vocab.eos_token_ids else len(path) + 1

    def fill_bitmask_within(self, bitmask: torch.Tensor, row: int, tokens_left: int) -> None:
        if tokens_left > LOOKAHEAD:
            return self.fill_bitmask(bitmask, row)
        path = self._path()
        needed = None if path is None else (len(path) if path and path[-1] in self._closing_vocab.eos_token_ids
                                            else len(path) + 1)
        if needed is None or tokens_left > needed + MARGIN:
            return self.fill_bitmask(bitmask, row)
        target = bitmask[row]
        target.zero_()
        first = path[0] if path else self._closing_vocab.eos_token_ids[0]
        words = target.numpy().view(np.uint32)
        words[first >> 5] |= np.uint32(1 << (first & 31))
