"""The green list of Kirchenbauer et al. (2023), "A Watermark for Large Language Models".

For the token at position ``t`` the vocabulary is split by the token at ``t - 1``:
``green_size = floor(gamma * vocab_size)`` tokens are green, the rest red. The split
is a keyed function of the previous token only, so a detector that knows the key
recomputes it from the text alone:

    seed  = BLAKE2b(prev.to_bytes(8, "little"), key=key_bytes, digest_size=8)
            read as a little-endian integer, top bit cleared (63 bits)
    perm  = torch.randperm(vocab_size, generator=torch.Generator("cpu").manual_seed(seed))
    green = perm[:green_size]

BLAKE2b in keyed mode is a MAC: without the key the seeds (and so the lists) cannot
be predicted, which is what keeps the watermark from being scrubbed or forged by
someone who only sees watermarked text. The permutation is torch's CPU ``randperm``
(the reference implementation and TGI use the same, seeded ``hash_key * prev``);
detection therefore needs the same key, gamma and vocabulary size, and a torch whose
CPU ``randperm`` has not changed its algorithm.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_KEY = "ember-watermark"  # public: a server that relies on the watermark sets its own
DEFAULT_GAMMA = 0.25  # as TGI (WATERMARK_GAMMA)
DEFAULT_DELTA = 2.0  # as TGI (WATERMARK_DELTA)
# Past about 50 a red token never wins anyway; a bound keeps logits + delta finite in
# float32 (1e308 would be infinity there, and softmax of infinities is NaN).
MAX_DELTA = 1000.0
_CACHE_SIZE = 512  # green lists kept per GreenList (12k ids each at SmolLM2's vocabulary)


def check_gamma(gamma: object, what: str = "gamma") -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 < gamma < 1.0:
        raise ValueError(f"watermark {what} must be a number in (0, 1), got {gamma!r}")
    return float(gamma)


def check_delta(delta: object, what: str = "delta") -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta <= MAX_DELTA:
        raise ValueError(f"watermark {what} must be a number in [0, {MAX_DELTA:g}], got {delta!r}")
    return float(delta)


def key_bytes(key: str | bytes | int) -> bytes:
    """The secret as BLAKE2b key bytes: a str is UTF-8, an int its decimal text."""
    if isinstance(key, bool):
        raise ValueError(f"watermark key must be a string, bytes or an integer, got {key!r}")
    if isinstance(key, int):
        key = str(key)
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes) or not 1 <= len(key) <= 64:
        raise ValueError(f"watermark key must be 1 to 64 bytes (BLAKE2b's key size), got {key!r}")
    return key


@dataclass(frozen=True)
class WatermarkSettings:
    """The server's watermark: its secret key and the default gamma and delta."""

    key: str | bytes | int = DEFAULT_KEY
    gamma: float = DEFAULT_GAMMA
    delta: float = DEFAULT_DELTA

    def __post_init__(self) -> None:
        key_bytes(self.key)
        check_gamma(self.gamma)
        check_delta(self.delta)

    @classmethod
    def from_options(cls, options: dict) -> WatermarkSettings:
        unknown = sorted(set(options) - {"key", "gamma", "delta"})
        if unknown:
            raise ValueError(f"unknown watermark option(s) {unknown}; known: key, gamma, delta")
        return cls(**options)


class GreenList:
    """The green lists of one (key, gamma, vocabulary size), by previous token."""

    def __init__(self, vocab_size: int, gamma: float, key: str | bytes | int = DEFAULT_KEY) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.gamma = check_gamma(gamma)
        self.green_size = int(gamma * vocab_size)
        if self.green_size < 1:
            raise ValueError(f"gamma {gamma} leaves no green token in a vocabulary of {vocab_size}")
        self._key = key_bytes(key)
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    def seed(self, prev_token_id: int) -> int:
        digest = hashlib.blake2b(prev_token_id.to_bytes(8, "little"), key=self._key, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def ids(self, prev_token_id: int) -> torch.Tensor:
        """The green token ids after ``prev_token_id``: ``(green_size,)`` int64, CPU,
        in permutation order (not sorted). Read-only: the tensor is cached."""
        green = self._cache.get(prev_token_id)
        if green is not None:
            self._cache.move_to_end(prev_token_id)
            return green
        generator = torch.Generator(device="cpu").manual_seed(self.seed(prev_token_id))
        green = torch.randperm(self.vocab_size, generator=generator)[: self.green_size]
        self._cache[prev_token_id] = green
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return green

    def mask(self, prev_token_id: int) -> torch.Tensor:
        """``(vocab_size,)`` bool, True on green ids."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids(prev_token_id)] = True
        return mask

    def is_green(self, prev_token_id: int, token_id: int) -> bool:
        return bool((self.ids(prev_token_id) == token_id).any())
