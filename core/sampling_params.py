"""Per-request sampling parameters (the vLLM-style `SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature == 0` means greedy. `top_k <= 0` (or -1) disables top-k;
    `top_p == 1.0` disables nucleus sampling. `seed` makes a request's samples
    reproducible whatever else shares its batch. Generation stops at EOS (unless
    `ignore_eos`), at any of `stop_token_ids`, or after `max_tokens` tokens;
    `min_tokens` suppresses EOS and stop tokens until that many were produced.
    `stop` strings end generation when they appear in the text; the text is cut
    before the stop string unless `include_stop_str_in_output`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept any iterable of ids (lists from JSON) but store a tuple: frozen
        # and hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range value."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {token_id!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
