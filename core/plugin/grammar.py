"""The grammar-backend contract: what a plugin implements to constrain decoding to a
JSON schema, a regular expression, a list of choices or a grammar.

A :class:`Constraint` is a request's wish, plain hashable data riding on its
`SamplingParams`. A backend (a :class:`BaseGrammarBackend` subclass, registered by
class through the ``ember_register_grammar_backends`` hook) is built once per engine
against the served model's tokenizer (:class:`GrammarContext`) and compiles a
constraint into a :class:`BaseCompiledGrammar`; that makes one
:class:`BaseGrammarMatcher` per request, which says which tokens may come next and
follows the tokens the request emits. The engine (``ember.engine.grammar_manager``) compiles
in a worker process (a backend whose grammars serialize, `serializes_grammars`) or on a
worker thread, caches what it compiled, and calls matchers directly on its own
thread: nothing per token goes through a hook.

Masks are packed bitmasks, as outlines-core, xgrammar and llguidance write them: a
row is ``ceil(vocab_size / 32)`` int32 words, and token ``t`` is allowed when bit
``t % 32`` of word ``t // 32`` is set. ``vocab_size`` is the model's (the width of its
logits), which may exceed the tokenizer's: those padding ids, and every special token
but EOS, are never allowed.

A backend that cannot express part of a constraint raises
:class:`UnsupportedFeatureError` naming the part (``minimum`` at
``/properties/age``), never a grammar that silently accepts more than was asked.
``ember.testing.check_grammar_backend`` checks an implementation against these rules.

**Closing within a budget** (optional): a matcher that can count the fewest tokens to
a valid end sets ``supports_budget`` and implements `min_tokens_to_end` and
`fill_bitmask_within`; the engine then keeps every constrained output closable within
its ``max_tokens`` and context (docs/grammar.md, "Outputs that always close"). A matcher
without it is masked by `fill_bitmask` alone, as before.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch

from ember.constraint import Constraint, ConstraintKind, choice_regex  # noqa: F401  (part of the grammar contract)


class GrammarError(ValueError):
    """A constraint that cannot be compiled: an invalid schema, regex or grammar (the
    message names the problem). A ValueError, so that callers answer it as bad input."""


class UnsupportedFeatureError(GrammarError):
    """A valid constraint using something this backend cannot express. ``feature``
    names it (a schema keyword with its location, a format, a constraint kind)."""

    def __init__(self, backend: str, feature: str, hint: str = "") -> None:
        self.backend = backend
        self.feature = feature
        self.hint = hint
        super().__init__(f"grammar backend {backend!r} does not support {feature}{hint}")

    def __reduce__(self):  # pickled across the engine-core process boundary
        return (type(self), (self.backend, self.feature, self.hint))


class GrammarCompileTimeout(GrammarError):
    """A grammar took longer to compile than the engine allows (EngineConfig.grammar_compile_timeout_s)."""


@dataclass(frozen=True)
class GrammarContext:
    """What a backend compiles against: the served model's tokenizer.

    ``vocab_size`` is the model's (the width of its logits and of a mask row:
    ``ceil(vocab_size / 32)`` words); ``eos_token_ids`` end a request, and are the
    only special tokens a grammar allows (where it may end). ``token_bytes`` (built
    once, on first use) holds each id's bytes as they appear in the decoded text,
    None for special tokens and padding ids (`ember.plugin.grammar_vocab`).
    """

    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def num_mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @cached_property
    def token_bytes(self) -> list[bytes | None]:
        from ember.plugin.grammar_vocab import decode_token_bytes

        return decode_token_bytes(self.tokenizer, self.vocab_size, self.eos_token_ids)


def set_tokens(row: torch.Tensor, token_ids: Sequence[int] | np.ndarray) -> None:
    """Set the bits of ``token_ids`` in one bitmask row (int32, CPU, ``(words,)``)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size:
        np.bitwise_or.at(row.numpy().view(np.uint32), ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))


def clear_tokens(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Clear the bits of ``token_ids`` in one bitmask row."""
    words = row.numpy().view(np.uint32)
    for token_id in token_ids:
        words[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))


def is_allowed(row: torch.Tensor, token_id: int) -> bool:
    """Whether one bitmask row allows ``token_id``."""
    return bool(row.numpy().view(np.uint32)[token_id >> 5] >> np.uint32(token_id & 31) & np.uint32(1))


def allows_only(row: torch.Tensor, token_ids: Sequence[int]) -> bool:
    """Whether one bitmask row allows no token outside ``token_ids``."""
    words = row.numpy().view(np.uint32).copy()
    for token_id in token_ids:
        words[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
    return not words.any()


class BaseGrammarMatcher(abc.ABC):
    """One request's position in a compiled grammar. Used by one thread at a time.

    A fresh matcher stands at the start of the grammar; it advances by the tokens the
    request emits and rolls back (speculative decoding advances it through draft
    tokens to mask each draft position, then rolls those back).
    """

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, contiguous,
        shape ``(rows, ceil(vocab_size / 32))``): every word of the row, the bit of
        each allowed token set, every other bit clear. EOS is allowed exactly where the
        grammar may end; once it is complete and cannot go on (`is_finished`), only
        EOS is. Special tokens and padding ids are never allowed. A matcher that
        followed allowed tokens always allows at least one token."""

    @abc.abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by ``token_ids`` in order, stopping at the first one the grammar does
        not allow there (an EOS where the grammar may end is allowed and ends it).
        Returns how many were accepted; the matcher then stands after those.
        Advancing by several at once equals advancing by each in turn."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (0 <= num_tokens <= the tokens
        accepted so far, up to the backend's ``max_rollback_tokens``); the masks are
        then those of that earlier position."""

    @property
    @abc.abstractmethod
    def is_finished(self) -> bool:
        """Whether the output so far is complete and no token but EOS may follow (or
        EOS was accepted): the engine then ends the request as stopped."""

    # -- optional: closing within a budget ------------------------------------------
    #: whether `min_tokens_to_end` and `fill_bitmask_within` are implemented (a
    #: matcher may also answer None from `min_tokens_to_end` for a grammar too large
    #: to measure)
    supports_budget: ClassVar[bool] = False

    def min_tokens_to_end(self) -> int | None:
        """The fewest tokens that end the output validly from here, the final EOS
        counted (1 where the output may end now; 0 once EOS was accepted); None when
        not known. Counting EOS even where the engine stops without one keeps the
        closing token inside ``max_tokens``, so the request ends as stopped."""
        return None

    def fill_bitmask_within(self, bitmask: torch.Tensor, row: int, tokens_left: int) -> None:
        """As `fill_bitmask`, keeping only the tokens after which the output can still
        end validly within ``tokens_left`` tokens (this one and the EOS counted). When
        ``tokens_left`` is below `min_tokens_to_end` no token can, and the row keeps
        those on a shortest path to an end. With ``tokens_left`` large it equals
        `fill_bitmask`. Only called when `supports_budget`."""
        self.fill_bitmask(bitmask, row)


class BaseCompiledGrammar(abc.ABC):
    """A constraint compiled against one tokenizer: immutable, shared by every request
    with the same constraint (the engine caches it), safe to use from any thread."""

    @abc.abstractmethod
    def create_matcher(self) -> BaseGrammarMatcher:
        """A matcher at the start of the grammar (cheap: called once per request)."""


class BaseGrammarBackend(abc.ABC):
    """A way of compiling constraints, registered by class under its ``name``.

    The engine builds one instance per tokenizer (``cls(context)``) on its compile
    thread, the first time a request asks for this backend: the constructor may be
    slow (vocabulary tables). ``compile`` runs on that thread too, and may take long;
    the engine gives up on it after ``EngineConfig.grammar_compile_timeout_s``.
    """

    name: ClassVar[str]
    # the constraint kinds `compile` accepts; another kind is refused before compiling
    supported_kinds: ClassVar[frozenset[ConstraintKind]]
    # how far back a matcher can always roll (at least 16: a speculation step)
    max_rollback_tokens: ClassVar[int]

    def __init__(self, context: GrammarContext) -> None:
        self.context = context

    @abc.abstractmethod
    def compile(self, constraint: Constraint) -> BaseCompiledGrammar:
        """Compile ``constraint`` (one of ``supported_kinds``). Raises GrammarError for
        an invalid constraint and UnsupportedFeatureError naming what the backend
        cannot express; never returns a grammar looser than the constraint."""

    # -- optional: compiled grammars that cross a process boundary -----------------------
    #: whether `dump_grammar` and `load_grammar` are implemented: the engine then compiles
    #: in a worker process (lowered priority, memory limit, killed at the timeout) and
    #: loads the result in its own; otherwise it compiles on a thread of its own process
    serializes_grammars: ClassVar[bool] = False

    def dump_grammar(self, grammar: BaseCompiledGrammar) -> bytes:
        """``grammar`` (compiled by this backend, in a worker process) as bytes for `load_grammar`."""
        raise NotImplementedError(f"grammar backend {self.name!r} does not serialize grammars")

    def load_grammar(self, data: bytes) -> BaseCompiledGrammar:
        """The grammar `dump_grammar` wrote, usable as if this backend had compiled it
        (called in the engine's process, on an instance built against the same tokenizer:
        cheap next to compiling)."""
        raise NotImplementedError(f"grammar backend {self.name!r} does not serialize grammars")

    @classmethod
    def check_kind(cls, constraint: Constraint) -> None:
        """Raise UnsupportedFeatureError if ``constraint``'s kind is not one this backend compiles."""
        if constraint.kind not in cls.supported_kinds:
            supported = ", ".join(sorted(k.value for k in cls.supported_kinds))
            raise UnsupportedFeatureError(
                cls.name, f"{constraint.kind.value} constraints", f" (it compiles: {supported})"
            )
