"""Per-request sampling parameters (the vLLM-style `SamplingParams`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from ember.constraint import Constraint
from ember.logprobs import MAX_LOGPROBS
from ember.pooling_params import PoolingParams

MAX_PARALLEL_SAMPLES = 16
# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): logits / 1e-300 would
# overflow to infinity, and the limit of sampling as temperature -> 0 is the argmax.
GREEDY_TEMPERATURE = 1e-5

# The fields core's sampler does not implement: a loaded logits processor that
# declares the field in its `params_fields` does (the `logits_typical` plugin for
# typical_p). A request setting one to a non-default value is refused when none does.
PLUGIN_FIELDS = ("typical_p",)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a reasoning model's thinking sits in its output, so that a constraint applies
    to the answer after it (`SamplingParams.grammar_after`; from the reasoning parser's
    `grammar_span`, docs/reasoning.md): the output is free until ``end_tag``; it starts
    inside the reasoning, or (``starts_inside`` False) only when it opens with ``start_tag``,
    the constraint applying from the first token otherwise."""

    start_tag: str
    end_tag: str
    starts_inside: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.end_tag, str) or not self.end_tag or not isinstance(self.start_tag, str):
            raise ValueError(f"a ReasoningSpan needs string tags (a non-empty end_tag), got {self!r}")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature == 0` means greedy, and so does any temperature below
    `GREEDY_TEMPERATURE` (1e-5). `top_k <= 0` (or -1) disables top-k;
    `top_p == 1.0` disables nucleus sampling. `seed` makes a request's samples
    reproducible whatever else shares its batch. Generation stops at EOS (unless
    `ignore_eos`), at any of `stop_token_ids`, or after `max_tokens` tokens;
    `min_tokens` suppresses EOS and stop tokens until that many were produced.
    `stop` strings end generation when they appear in the text; the text is cut
    before the stop string unless `include_stop_str_in_output`.

    Logits adjustments (docs/sampling.md has the full reference): `typical_p` in
    (0, 1] (1 disables; implemented by a plugin, PLUGIN_FIELDS), `min_p` in [0, 1] (0 disables), `repetition_penalty` > 0
    (1 disables; transformers' semantics over prompt and output tokens),
    `frequency_penalty` and `presence_penalty` in [-2, 2] (OpenAI's semantics over
    output tokens), `logit_bias` {token id: bias added to its logit},
    `bad_words_token_ids` token-id sequences never to generate (a one-token
    sequence bans that token). `extra` switches on third-party processors: each key
    names a registered processor, its value is that processor's parameters.

    `constraint` (an `ember.constraint.Constraint`: a JSON schema, a regex, a choice, a
    grammar) restricts the output to what it matches (docs/grammar.md), compiled by the
    grammar backend `grammar_backend` names (None: the engine's
    `EngineConfig.grammar_backend`). A request whose output completes the grammar ends
    there (finish reason "stop"); one whose grammar cannot be compiled ends with finish
    reason "error" and the message in `CompletionOutput.error`.

    `logprobs=N` returns, per generated token, its logprob and rank and the N most
    likely alternatives; `prompt_logprobs=N` the same per prompt token (the first
    has none). Both in [0, MAX_LOGPROBS]; None (the default) costs nothing.
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
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    extra: dict[str, Any] = field(default_factory=dict)
    # Logprobs (docs/sampling.md): alternatives per generated token / per prompt token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Parallel sampling: `n` completions of one prompt, drawn from `best_of` (>= n)
    # candidates; they share the prompt's KV blocks (docs/sampling.md).
    n: int = 1
    best_of: int | None = None
    # How the n completions are chosen from best_of candidates: by "cumulative"
    # logprob (vLLM, OpenAI) or by "mean" logprob per token (TGI).
    best_of_ranking: str = "cumulative"
    # Grammar-guided decoding (docs/grammar.md).
    # grammar_after: the constraint applies after the reasoning (ReasoningSpan) only
    grammar_after: ReasoningSpan | None = None
    constraint: Constraint | None = None
    grammar_backend: str | None = None
    # A pooling request (ember.pooling_params, docs/embeddings.md): its prompt is computed and
    # pooled into a vector (RequestOutput.pooled); nothing is sampled. Use `SamplingParams.for_pooling`.
    pooling: PoolingParams | None = None

    @classmethod
    def for_pooling(cls, pooling: PoolingParams | None = None) -> SamplingParams:
        """The params of a pooling request (one position computed past the prompt is never sampled)."""
        return cls(max_tokens=1, temperature=0.0, pooling=pooling or PoolingParams())

    def __post_init__(self) -> None:
        # Accept any iterable of ids (lists from JSON) but store a tuple: frozen
        # and hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        for name in ("logit_bias", "extra"):
            value = getattr(self, name) or {}
            if not isinstance(value, Mapping):
                raise ValueError(f"{name} must be a dict, got {value!r}")
            object.__setattr__(self, name, dict(value))  # a copy: the caller's dict may change
        words = self.bad_words_token_ids or ()
        if not isinstance(words, (list, tuple)) or any(not isinstance(w, (list, tuple)) for w in words):
            raise ValueError(f"bad_words_token_ids must be a list of token-id lists, got {words!r}")
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in words))
        if isinstance(self.pooling, PoolingParams):  # generates nothing: no token budget (nor drafts) to spend
            object.__setattr__(self, "max_tokens", 1)
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
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
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
        self._validate_processor_fields()
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_PARALLEL_SAMPLES:
            raise ValueError(f"n must be an integer in [1, {MAX_PARALLEL_SAMPLES}], got {self.n!r}")
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or isinstance(self.best_of, bool)
            or not self.n <= self.best_of <= MAX_PARALLEL_SAMPLES
        ):
            raise ValueError(f"best_of must be an integer in [n={self.n}, {MAX_PARALLEL_SAMPLES}], got {self.best_of!r}")
        if self.best_of_ranking not in ("cumulative", "mean"):
            raise ValueError(f"best_of_ranking must be 'cumulative' or 'mean', got {self.best_of_ranking!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(
                f"constraint must be an ember.constraint.Constraint (e.g. Constraint.json_schema(schema)), "
                f"got {self.constraint!r}"
            )
        if self.grammar_backend is not None and (not isinstance(self.grammar_backend, str) or not self.grammar_backend):
            raise ValueError(f"grammar_backend must be None or a backend name, got {self.grammar_backend!r}")
        if self.grammar_after is not None and not isinstance(self.grammar_after, ReasoningSpan):
            raise ValueError(f"grammar_after must be None or an ember.sampling_params.ReasoningSpan, "
                             f"got {self.grammar_after!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingParams):
                raise ValueError(f"pooling must be an ember.pooling_params.PoolingParams, got {self.pooling!r}")
            if self.num_samples > 1 or self.constraint is not None or self.logprobs is not None \
                    or self.prompt_logprobs is not None:
                raise ValueError("a pooling request samples nothing: n, best_of, constraint and logprobs do not apply")

    def _validate_processor_fields(self) -> None:
        if not _is_number(self.typical_p) or not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_token_id(token_id):
                raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {token_id!r}")
            if not _is_number(bias):
                raise ValueError(f"logit_bias[{token_id}] must be a finite number, got {bias!r}")
        for word in self.bad_words_token_ids:
            if not word or not all(_is_token_id(t) for t in word):
                raise ValueError(
                    f"bad_words_token_ids must hold non-empty lists of non-negative token ids, got {list(word)!r}"
                )
        for key in self.extra:
            if not isinstance(key, str) or not key:
                raise ValueError(f"extra keys must be non-empty logits-processor names, got {key!r}")
            if key in _FIELD_NAMES:
                raise ValueError(f"extra key {key!r} is a sampling parameter; set SamplingParams.{key} instead")

    @property
    def logits_processor_names(self) -> tuple[str, ...]:
        """The processors this request names through `extra` (its keys). Processors
        that implement a PLUGIN_FIELDS field switch on from it instead
        (`BaseLogitsProcessor.is_enabled`); see `plugin_fields_used`."""
        return tuple(self.extra)

    @property
    def plugin_fields_used(self) -> tuple[str, ...]:
        """The PLUGIN_FIELDS this request sets to a non-default value: each needs a
        loaded processor that declares it (`LogitsPipeline.validate`)."""
        return tuple(name for name in PLUGIN_FIELDS if getattr(self, name) != _PLUGIN_FIELD_DEFAULTS[name])

    @cached_property  # frozen: computed once (the sampler asks every step)
    def uses_plugin_processors(self) -> bool:
        """Whether the request names any plugin processor (an `extra` key or a
        PLUGIN_FIELDS field set): only then does it go through the pipeline."""
        return bool(self.extra) or any(getattr(self, name) != _PLUGIN_FIELD_DEFAULTS[name] for name in PLUGIN_FIELDS)

    @property
    def num_samples(self) -> int:
        """How many sequences the engine runs for this request (best_of, else n)."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @cached_property  # frozen: computed once (the sampler asks every step)
    def is_unadjusted_greedy(self) -> bool:
        """Greedy with none of core's logit adjustments (bias, penalties, bad words);
        ``min_tokens`` and plugin processors are the sampler's to check per step."""
        return self.is_greedy and not self.logit_bias and self.repetition_penalty == 1.0 \
            and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0 and not self.bad_words_token_ids


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_PLUGIN_FIELD_DEFAULTS = {f.name: f.default for f in fields(SamplingParams) if f.name in PLUGIN_FIELDS}


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int, stream: int = 0) -> int:
    """The seed of a seeded request's draws for its output token ``position``:
    splitmix64 over (seed, position, stream), so that neighbouring seeds and
    positions give unrelated streams. Non-negative, under 2**63."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1
