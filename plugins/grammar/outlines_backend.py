"""The ``outlines`` grammar backend (the default): outlines-core, the engine of the
Outlines library, TGI and vLLM's ``outlines`` backend.

A constraint becomes a regular expression (a JSON schema through outlines-core's
``build_regex_from_schema``, with at most one space between tokens of JSON); the
regex becomes an ``Index``, a DFA over the model's tokens; a matcher is a ``Guide``
walking it, which writes each step's bitmask itself. Compiling a large schema takes
seconds (the index covers the whole vocabulary); stepping costs one mask write.

It compiles JSON schemas, ``json_object``, regexes and choices, not EBNF or Lark
grammars. In schemas it enforces the keywords in `KEYWORDS` and the formats in
`FORMATS` and refuses every other keyword: outlines-core would drop ``minimum``,
``maximum``, ``multipleOf``, ``uniqueItems``, ``minProperties``, ``patternProperties``
and read ``oneOf`` as ``anyOf``, and of competing keywords in one node it keeps one
(``json_schema.exclusive_keywords``, ``lengths_alone``). Objects hold only the properties the schema lists
(``additionalProperties`` other than a schema adds none), in the schema's order.
Dates and times follow RFC 3339 (``json_schema.FORMAT_PATTERNS``), not outlines-core's
looser grammars.

Matchers close within a budget (``supports_budget``): each compiled grammar measures,
once, every state's distance in tokens to an end (`token_distance`).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence

import torch

from ember.plugin import Registry, hookimpl
from ember.plugin.grammar import (
    BaseCompiledGrammar,
    BaseGrammarBackend,
    BaseGrammarMatcher,
    Constraint,
    ConstraintKind,
    GrammarContext,
    GrammarError,
    UnsupportedFeatureError,
    allows_only,
    choice_regex,
    set_tokens,
)
from ember.plugins.grammar import token_distance
from ember.plugins.grammar.json_schema import (
    check_schema,
    exclusive_keywords,
    formats_as_patterns,
    lengths_alone,
    rewrite_schema,
)

KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
})
FORMATS = frozenset({"date", "date-time", "time", "email", "uuid", "uri"})
MAX_ROLLBACK_TOKENS = 1 << 16  # the Guide keeps this many past states (a few bytes each)


class OutlinesGrammar(BaseCompiledGrammar):
    def __init__(self, index, context: GrammarContext, distances: token_distance.TokenDistances | None | bool = False,
                 ) -> None:
        self.index = index
        self.eos_token_ids = context.eos_token_ids
        self.num_words = context.num_mask_words
        # None for an index too large to measure (token_distance.MAX_TRANSITIONS); measured
        # here unless given (a grammar loaded from a compile worker brings its own)
        if distances is False:
            distances = token_distance.measure(index.get_transitions(), index.get_final_states(), self.eos_token_ids)
        self.distances = distances
        # per final state: whether it allows nothing but EOS (computed when first reached)
        self._is_end_state: dict[int, bool] = {}

    def create_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)

    def is_end_state(self, guide) -> bool:
        state = guide.get_state()
        known = self._is_end_state.get(state)
        if known is None:
            row = torch.empty(self.num_words, dtype=torch.int32)
            guide.write_mask_into(row.data_ptr(), row.numel(), 4)
            known = self._is_end_state[state] = allows_only(row, self.eos_token_ids)
        return known


class OutlinesMatcher(BaseGrammarMatcher):
    def __init__(self, grammar: OutlinesGrammar) -> None:
        from outlines_core import Guide

        self._grammar = grammar
        self._guide = Guide(grammar.index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._has_eos = False  # EOS accepted (the Guide itself never takes it)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        eos = self._grammar.eos_token_ids
        if self._has_eos:
            target.zero_()
        else:
            self._guide.write_mask_into(target.data_ptr(), target.numel(), 4)  # clears the row first
            if not self._guide.is_finished():
                return
        set_tokens(target, eos)  # outlines-core knows one EOS; a model may have several

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        eos = self._grammar.eos_token_ids
        for num, token_id in enumerate(token_ids):
            if self._has_eos:
                return num
            if token_id in eos:
                if not self._guide.is_finished():
                    return num
                self._has_eos = True
                continue
            try:
                self._guide.advance(token_id, return_tokens=False)
            except ValueError:  # not allowed here; the Guide did not move
                return num
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._has_eos:
            self._has_eos = False
            num_tokens -= 1
        if num_tokens:
            self._guide.rollback_state(num_tokens)

    @property
    def is_finished(self) -> bool:
        return self._has_eos or (self._guide.is_finished() and self._grammar.is_end_state(self._guide))

    supports_budget = True

    def min_tokens_to_end(self) -> int | None:
        if self._has_eos:
            return 0
        distances = self._grammar.distances
        return None if distances is None else distances.distance(self._guide.get_state())

    def fill_bitmask_within(self, bitmask: torch.Tensor, row: int, tokens_left: int) -> None:
        distances = self._grammar.distances
        if self._has_eos or distances is None:
            return self.fill_bitmask(bitmask, row)
        state = self._guide.get_state()
        # after this token, tokens_left - 1 remain for the rest and the EOS; below the
        # distance nothing fits, and a shortest path is the best left
        limit = max(tokens_left - 1, distances.distance(state) - 1)
        state_row = distances.row(state)
        if state_row.max_distance <= limit:
            return self.fill_bitmask(bitmask, row)  # the budget does not bite here
        target = bitmask[row]
        target.zero_()
        set_tokens(target, state_row.within(limit))
        if self._guide.is_finished():
            set_tokens(target, self._grammar.eos_token_ids)


class OutlinesBackend(BaseGrammarBackend):
    name = "outlines"
    supported_kinds = frozenset({
        ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT, ConstraintKind.REGEX, ConstraintKind.CHOICE,
    })
    max_rollback_tokens = MAX_ROLLBACK_TOKENS

    def __init__(self, context: GrammarContext) -> None:
        from outlines_core import Vocabulary

        super().__init__(context)
        if not context.eos_token_ids:
            raise ValueError("the outlines grammar backend needs the model's EOS token id")
        tokens: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(context.token_bytes):
            if data is not None:
                tokens.setdefault(data, []).append(token_id)
        self.vocabulary = Vocabulary(context.eos_token_ids[0], tokens)

    def compile(self, constraint: Constraint) -> OutlinesGrammar:
        from outlines_core import Index

        self.check_kind(constraint)
        regex = self.to_regex(constraint)
        try:
            index = Index(regex, self.vocabulary)
        except ValueError as exc:
            raise GrammarError(f"outlines cannot compile {constraint.describe()}: {exc}") from None
        return OutlinesGrammar(index, self.context)

    # a grammar is its Index (outlines-core pickles it as its binary form) and its distances (numpy arrays)
    serializes_grammars = True

    def dump_grammar(self, grammar: OutlinesGrammar) -> bytes:
        return pickle.dumps((grammar.index, grammar.distances), protocol=pickle.HIGHEST_PROTOCOL)

    def load_grammar(self, data: bytes) -> OutlinesGrammar:
        index, distances = pickle.loads(data)
        return OutlinesGrammar(index, self.context, distances)

    def to_regex(self, constraint: Constraint) -> str:
        """The regular expression outlines-core compiles for ``constraint``."""
        from outlines_core.json_schema import build_regex_from_schema

        if constraint.kind is ConstraintKind.REGEX:
            return constraint.value
        if constraint.kind is ConstraintKind.CHOICE:
            return choice_regex(constraint.value)
        schema = constraint.schema
        check_schema(schema, self.name, KEYWORDS, FORMATS, (exclusive_keywords, lengths_alone))
        schema = rewrite_schema(schema, formats_as_patterns)
        try:
            return build_regex_from_schema(json.dumps(schema))
        except ValueError as exc:
            message = str(exc).split("\n")[0]
            if "not supported" in message:
                raise UnsupportedFeatureError(self.name, message) from None
            raise GrammarError(f"outlines cannot compile {constraint.describe()}: {message}") from None


@hookimpl
def ember_register_grammar_backends(registry: Registry) -> None:
    registry.register(OutlinesBackend.name, OutlinesBackend)
