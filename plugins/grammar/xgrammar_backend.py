"""The ``xgrammar`` grammar backend: XGrammar (MLC), a pushdown automaton over the
model's tokens with precomputed masks for context-independent tokens.

It compiles every constraint kind: JSON schemas and ``json_object`` (compact JSON: one
space after ``,`` and ``:``; objects hold only the listed properties, in the schema's
order), regexes, choices, GBNF (llama.cpp's EBNF, start rule ``root``) and Lark
grammars (start rule ``start``). Compiling is fast (milliseconds for most schemas).
In schemas it enforces the keywords in `KEYWORDS` and the formats in `FORMATS`
(``multipleOf`` on integers only) and refuses every other keyword: xgrammar would read
``oneOf`` as ``anyOf`` and drop ``uniqueItems``, ``not``, ``if``/``then``,
``patternProperties``, unknown formats and a number's ``multipleOf``, and of competing
keywords in one node it keeps one (``json_schema.exclusive_keywords``,
``lengths_alone``). A bounded string (``minLength``/``maxLength``) is compiled as the
equivalent pattern over characters that need no escape (`_bounded_string_pattern`).

Matchers close within a budget by a bounded greedy walk to an end (`closing_path`):
xgrammar has no distances to measure, so the path is a way to end, not always the
shortest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

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
from ember.plugins.grammar.closing_path import ClosingMatcher, ClosingVocab
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
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# xgrammar has more (ipv4 among them, but it allows leading zeros, which the format forbids)
FORMATS = frozenset({"date", "date-time", "time", "email", "uuid", "uri"})
# "[12:00:00] /project/cpp/json_schema_converter.cc:1094: " before xgrammar's messages
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _integer_multiple_of(node: dict[str, Any], where: str, backend: str) -> None:
    if "multipleOf" in node and node.get("type") != "integer":
        raise UnsupportedFeatureError(backend, f"'multipleOf' outside an integer schema (at {where})")


# One character JSON needs no escape for, as xgrammar must match it: a class per UTF-8
# length. In one class (``[^"\\]`` or ``[\u0080-\uffff]``) xgrammar 0.2.9 reads a lead
# byte's payload without checking its continuation: it admits overlong encodings such as
# b"\xe0\x99\xad", which are not UTF-8 (SmolLM2 wrote them under a maxLength).
UNESCAPED_CHAR = r'([ !#-\[\]-~]|[\u0080-\u07ff]|[\u0800-\ud7ff]|[\ue000-\uffff]|[\u{10000}-\u{10ffff}])'


def _bounded_string_pattern(node: dict[str, Any]) -> dict[str, Any]:
    """xgrammar 0.2.9 writes a string with ``minLength``/``maxLength`` over a character
    class that admits raw control characters and no escapes (invalid JSON): give it the
    same bounds as a pattern over the characters JSON needs no escape for, counted in
    characters (`UNESCAPED_CHAR`), each valid UTF-8."""
    if node.get("type") != "string" or not ("minLength" in node or "maxLength" in node):
        return node
    low, high = node.pop("minLength", 0), node.pop("maxLength", "")
    node["pattern"] = f"^{UNESCAPED_CHAR}{{{low},{high}}}$"
    return node


class XGrammarGrammar(BaseCompiledGrammar):
    def __init__(self, compiled, context: GrammarContext, closing_vocab: ClosingVocab) -> None:
        self.compiled = compiled
        self.eos_token_ids = context.eos_token_ids
        self.num_words = context.num_mask_words
        self.closing_vocab = closing_vocab

    def create_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)


class XGrammarMatcher(ClosingMatcher, BaseGrammarMatcher):
    def __init__(self, grammar: XGrammarGrammar) -> None:
        import xgrammar

        self._grammar = grammar
        self._closing_vocab = grammar.closing_vocab
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=list(grammar.eos_token_ids))
        self._scratch: torch.Tensor | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():  # after EOS xgrammar writes no mask
            bitmask[row].zero_()
            set_tokens(bitmask[row], self._grammar.eos_token_ids)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        for num, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(token_id):
                return num
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        matcher = self._matcher
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        if self._scratch is None:
            self._scratch = torch.empty((1, self._grammar.num_words), dtype=torch.int32)
        matcher.fill_next_token_bitmask(self._scratch, 0)
        return allows_only(self._scratch[0], self._grammar.eos_token_ids)


class XGrammarBackend(BaseGrammarBackend):
    name = "xgrammar"
    supported_kinds = frozenset(ConstraintKind)
    max_rollback_tokens = 1 << 30  # unlimited since xgrammar 0.1.20 (its Earley parser keeps every state)

    def __init__(self, context: GrammarContext) -> None:
        import xgrammar

        super().__init__(context)
        # Ember's own decoding of the vocabulary (ember.plugin.grammar_vocab), as outlines gets
        # it: special tokens and padding ids are empty strings, which xgrammar never allows.
        info = self.tokenizer_info = xgrammar.TokenizerInfo(
            [data or b"" for data in context.token_bytes], xgrammar.VocabType.RAW,
            vocab_size=context.vocab_size, stop_token_ids=list(context.eos_token_ids),
        )
        # the engine caches compiled grammars itself; one thread each (compiles run in parallel)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.closing_vocab = ClosingVocab(context.token_bytes, context.eos_token_ids, context.vocab_size)

    def compile(self, constraint: Constraint) -> XGrammarGrammar:
        self.check_kind(constraint)
        kind, compiler = constraint.kind, self.compiler
        if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
            schema = constraint.schema
            check_schema(schema, self.name, KEYWORDS, FORMATS, (exclusive_keywords, lengths_alone, _integer_multiple_of))
            schema = rewrite_schema(rewrite_schema(schema, _bounded_string_pattern), formats_as_patterns)
        try:
            if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
                compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            elif kind is ConstraintKind.REGEX:
                compiled = compiler.compile_regex(constraint.value)
            elif kind is ConstraintKind.CHOICE:
                compiled = compiler.compile_regex(choice_regex(constraint.value))
            elif kind is ConstraintKind.EBNF:
                compiled = compiler.compile_grammar(constraint.value)
            else:
                compiled = compiler.compile_lark(constraint.value)
        except (RuntimeError, ValueError) as exc:
            message = _LOCATION.sub("", str(exc).strip().split("\n")[0])
            raise GrammarError(f"xgrammar cannot compile {constraint.describe()}: {message}") from None
        return XGrammarGrammar(compiled, self.context, self.closing_vocab)

    # xgrammar writes a compiled grammar as JSON and reads it back against the same tokenizer info
    serializes_grammars = True

    def dump_grammar(self, grammar: XGrammarGrammar) -> bytes:
        return grammar.compiled.serialize_json().encode()

    def load_grammar(self, data: bytes) -> XGrammarGrammar:
        import xgrammar

        compiled = xgrammar.CompiledGrammar.deserialize_json(data.decode(), self.tokenizer_info)
        return XGrammarGrammar(compiled, self.context, self.closing_vocab)


@hookimpl
def ember_register_grammar_backends(registry: Registry) -> None:
    registry.register(XGrammarBackend.name, XGrammarBackend)
