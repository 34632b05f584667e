"""Conformance check for grammar backends: does a :class:`BaseGrammarBackend` keep the
contract in :mod:`ember.plugin.grammar`? Ember runs it against its built-ins; a third party
runs it against theirs::

    from ember.testing import check_grammar_backend

    def test_my_backend_conforms():
        check_grammar_backend(MyBackend)                    # a tiny byte-level tokenizer
        check_grammar_backend(MyBackend, real_tokenizer)    # and a real one

For each constraint kind the backend supports it compiles a few constraints and walks
them at random, each step taking a token the mask allows, and checks: the output
matches the regex, is one of the choices, parses and validates against the schema
(``jsonschema``, with its format checker); a mask never allows a special token or a
padding id and never allows nothing; EOS is allowed exactly where the output is
complete (only EOS once the grammar is finished); advancing by several tokens at once
equals advancing by each; a rejected token stops `accept_tokens` and leaves the matcher
where it was; rollback restores the earlier masks. A matcher that ``supports_budget``
is walked within random budgets from `min_tokens_to_end` up: every walk must end
complete within its budget (EOS counted), each budget mask a part of the full mask,
equal to it when the budget is large. A backend that ``serializes_grammars`` must load
what it dumped into a grammar with the same masks (walked again). Kinds it does not support, and
schema keywords it cannot enforce, must raise UnsupportedFeatureError naming them;
an invalid regex or schema a GrammarError. Raises AssertionError describing the first
broken rule.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ember.plugin.grammar import (
    BaseCompiledGrammar,
    BaseGrammarBackend,
    Constraint,
    ConstraintKind,
    GrammarContext,
    GrammarError,
    UnsupportedFeatureError,
)

MAX_STEPS = 400
# a walk takes EOS with this chance where it is allowed (else it goes on, where it can)
EOS_CHANCE = 0.3

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 7, None]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{1,3}$"}, "minItems": 1,
                 "maxItems": 3},
        "owner": {"$ref": "#/$defs/person"},
        "score": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 2}]},
        "note": {"type": "string", "minLength": 2, "maxLength": 4},
    },
    "required": ["name", "kind", "tags", "owner"],
    "$defs": {
        "person": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
            "required": ["id"],
        },
    },
}
# Schemas using a keyword each: a backend enforces it (its walks validate) or refuses it
# with UnsupportedFeatureError naming the keyword.
HARD_SCHEMAS = [
    ("minimum", {"type": "integer", "minimum": 5, "maximum": 9}),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}),
    ("multipleOf", {"type": "integer", "multipleOf": 3}),
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}),
    ("not", {"not": {"type": "integer"}}),
    ("minProperties", {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}),
    ("format", {"type": "string", "format": "ipv4"}),
    ("format", {"type": "string", "format": "no-such-format"}),
]


@dataclass
class _Case:
    constraint: Constraint
    is_complete: Callable[[str], bool]  # whether this output text satisfies the constraint
    exact_eos: bool  # EOS must be allowed exactly where is_complete holds (else: only there)


def _schema_check(schema: dict) -> Callable[[str], bool]:
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError("check_grammar_backend needs jsonschema: pip install jsonschema") from exc
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)

    def check(text: str) -> bool:
        try:
            return validator.is_valid(json.loads(text))
        except json.JSONDecodeError:
            return False

    return check


def _cases(kinds: frozenset[ConstraintKind]) -> list[_Case]:
    regex = r"[a-c]{2,4}(-[0-9]{1,2})?"
    choices = ("yes", "no", "maybe so", "a.b*c", "no way")
    cases = {
        ConstraintKind.REGEX: [_Case(Constraint.regex(regex), lambda t: re.fullmatch(regex, t) is not None, True)],
        ConstraintKind.CHOICE: [_Case(Constraint.choice(choices), lambda t: t in choices, True)],
        ConstraintKind.JSON_SCHEMA: [
            _Case(Constraint.json_schema(NESTED_SCHEMA), _schema_check(NESTED_SCHEMA), False),
            _Case(Constraint.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
                  _schema_check({"type": "array", "items": {"type": "integer"}, "maxItems": 3}), False),
        ],
        ConstraintKind.JSON_OBJECT: [_Case(Constraint.json_object(), _schema_check({"type": "object"}), False)],
        ConstraintKind.EBNF: [_Case(Constraint.ebnf('root ::= "(" [a-c]* ")" | "x"'),
                                    lambda t: re.fullmatch(r"\([a-c]*\)|x", t) is not None, True)],
        ConstraintKind.LARK: [_Case(Constraint.lark('start: "n=" NUM\nNUM: /[0-9]{1,3}/'),
                                    lambda t: re.fullmatch(r"n=[0-9]{1,3}", t) is not None, True)],
    }
    return [case for kind in ConstraintKind if kind in kinds for case in cases[kind]]


class _Checker:
    def __init__(
        self, cls: type[BaseGrammarBackend], context: GrammarContext, num_walks: int, seed: int, strict_utf8: bool,
    ) -> None:
        self.cls = cls
        self.strict_utf8 = strict_utf8
        self.context = context
        self.backend = cls(context)
        self.num_walks = num_walks
        self.rng = random.Random(seed)
        self.eos = set(context.eos_token_ids)
        self.token_bytes = context.token_bytes
        self.never = np.array([t is None and t_id not in self.eos for t_id, t in enumerate(self.token_bytes)])
        self.bitmask = torch.zeros((1, context.num_mask_words), dtype=torch.int32)

    def allowed(self, matcher, tokens_left: int | None = None) -> np.ndarray:
        """The bool row of tokens ``matcher`` allows now (a copy), within ``tokens_left``."""
        self.bitmask.fill_(-1)  # a matcher must write every word of its row
        if tokens_left is None:
            matcher.fill_bitmask(self.bitmask, 0)
        else:
            matcher.fill_bitmask_within(self.bitmask, 0, tokens_left)
        return np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, count=self.context.vocab_size,
                             bitorder="little")[0].astype(bool)

    def walk(self, grammar: BaseCompiledGrammar, case: _Case, where: str) -> None:
        name = self.cls.name
        matcher = grammar.create_matcher()
        tokens: list[int] = []
        masks: list[np.ndarray] = []
        data = b""
        for _ in range(MAX_STEPS):
            allowed = self.allowed(matcher)
            masks.append(allowed)
            ids = np.flatnonzero(allowed).tolist()
            text = data.decode("utf-8", errors="replace")
            assert ids, f"{name}: {where}: the mask allows no token after {text!r}"
            bad = np.flatnonzero(allowed & self.never).tolist()
            assert not bad, f"{name}: {where}: the mask allows special or padding ids {bad[:5]} after {text!r}"
            eos_allowed = bool(self.eos & set(ids))
            if eos_allowed:
                assert case.is_complete(text), f"{name}: {where}: EOS allowed after {text!r}, which is not complete"
            elif case.exact_eos:
                assert not case.is_complete(text), f"{name}: {where}: EOS not allowed after complete {text!r}"
            if matcher.is_finished:
                assert set(ids) <= self.eos, f"{name}: {where}: finished after {text!r} but allows more than EOS"
            non_eos = [t for t in ids if t not in self.eos]
            if eos_allowed and (not non_eos or self.rng.random() < EOS_CHANCE):
                token = self.rng.choice(sorted(self.eos & set(ids)))
            else:
                token = self.pick(non_eos, data, where)
            assert matcher.accept_tokens([token]) == 1, f"{name}: {where}: an allowed token {token} was refused"
            tokens.append(token)
            if token in self.eos:
                assert matcher.is_finished, f"{name}: {where}: not finished after EOS"
                assert set(np.flatnonzero(self.allowed(matcher)).tolist()) <= self.eos, (
                    f"{name}: {where}: allows more than EOS after EOS"
                )
                break
            data += self.token_bytes[token]
        else:
            return  # a long walk (an unbounded grammar): its invariants held all along
        assert case.is_complete(data.decode("utf-8")), f"{name}: {where}: the output {data!r} is not complete"
        self.check_replay(grammar, tokens, masks, where)

    def pick(self, candidates: list[int], data: bytes, where: str) -> int:
        """A random token of ``candidates``; with ``strict_utf8`` off, one that keeps
        ``data`` a valid UTF-8 prefix (a model's text is UTF-8: the walk stays on it)."""
        for _ in range(64):
            token = self.rng.choice(candidates)
            if self.strict_utf8 or _is_utf8_prefix(data + self.token_bytes[token]):
                return token
        raise AssertionError(f"{self.cls.name}: {where}: no allowed token keeps {data!r} valid UTF-8")

    def check_replay(self, grammar: BaseCompiledGrammar, tokens: list[int], masks: list[np.ndarray], where) -> None:
        name = self.cls.name
        matcher = grammar.create_matcher()
        assert matcher.accept_tokens(tokens) == len(tokens), f"{name}: {where}: advancing by all tokens at once failed"
        assert matcher.is_finished, f"{name}: {where}: not finished after the walk's tokens at once"
        last = self.allowed(matcher)
        # rollback restores each earlier position's mask; advancing again returns to the end
        for back in sorted(self.rng.sample(range(1, len(tokens) + 1), min(4, len(tokens)))):
            back = min(back, self.cls.max_rollback_tokens)
            matcher.rollback(back)
            position = len(tokens) - back
            assert np.array_equal(self.allowed(matcher), masks[position]), (
                f"{name}: {where}: after rolling back {back} tokens the mask differs from the one at position {position}"
            )
            if position < len(tokens) - 1:
                assert not matcher.is_finished, f"{name}: {where}: finished after rolling back {back} tokens"
            assert matcher.accept_tokens(tokens[position:]) == back, f"{name}: {where}: re-advancing failed"
            assert np.array_equal(self.allowed(matcher), last), f"{name}: {where}: re-advancing changed the final mask"
        # a refused token stops accept_tokens and moves nothing
        fresh = grammar.create_matcher()
        refused = np.flatnonzero(~masks[1] & ~self.never).tolist() if len(tokens) > 1 else []
        refused = [t for t in refused if t not in self.eos]
        if refused:
            num = fresh.accept_tokens([tokens[0], refused[0], tokens[1]])
            assert num == 1, f"{name}: {where}: accept_tokens took {num} tokens of [allowed, refused {refused[0]}, ...]"
            assert np.array_equal(self.allowed(fresh), masks[1]), f"{name}: {where}: a refused token moved the matcher"

    def check_cases(self) -> None:
        for case in _cases(self.cls.supported_kinds):
            where = case.constraint.describe(40)
            grammar = self.backend.compile(case.constraint)
            for i in range(self.num_walks):
                self.walk(grammar, case, f"{where} walk {i}")

    def check_serialization(self) -> None:
        """A backend that ``serializes_grammars``: each grammar, written by `dump_grammar` and
        read by `load_grammar` of another instance (as in the engine's process), masks as
        the original and walks to valid outputs."""
        if not self.cls.serializes_grammars:
            return
        name, loader = self.cls.name, self.cls(self.context)
        for case in _cases(self.cls.supported_kinds):
            where = f"{case.constraint.describe(40)} (dumped and loaded)"
            grammar = self.backend.compile(case.constraint)
            data = self.backend.dump_grammar(grammar)
            assert isinstance(data, bytes), f"{name}: {where}: dump_grammar returned {type(data).__name__}, not bytes"
            loaded = loader.load_grammar(data)
            assert isinstance(loaded, BaseCompiledGrammar), f"{name}: {where}: load_grammar returned {loaded!r}"
            assert np.array_equal(self.allowed(loaded.create_matcher()), self.allowed(grammar.create_matcher())), (
                f"{name}: {where}: the loaded grammar's first mask differs from the compiled one's"
            )
            for i in range(min(self.num_walks, 3)):
                self.walk(loaded, case, f"{where} walk {i}")

    def check_budget(self) -> None:
        for case in _cases(self.cls.supported_kinds):
            grammar = self.backend.compile(case.constraint)
            if not grammar.create_matcher().supports_budget:
                return
            for i in range(self.num_walks):
                self.walk_within(grammar, case, f"{case.constraint.describe(40)} budget walk {i}")

    def walk_within(self, grammar: BaseCompiledGrammar, case: _Case, where: str) -> None:
        name = self.cls.name
        matcher = grammar.create_matcher()
        start = matcher.min_tokens_to_end()
        if start is None:
            return  # too large to measure: allowed
        assert isinstance(start, int) and start >= 1, f"{name}: {where}: min_tokens_to_end at the start is {start!r}"
        budget = start + self.rng.randint(0, 6)
        data, used = b"", 0
        while True:
            left = budget - used
            distance = matcher.min_tokens_to_end()
            assert distance is not None and distance <= left, (
                f"{name}: {where}: {left} tokens left but {distance} needed after {data!r} (budget {budget})"
            )
            within, full = self.allowed(matcher, left), self.allowed(matcher)
            assert within.any() and not (within & ~full).any(), (
                f"{name}: {where}: the budget mask is empty or allows what the grammar does not, after {data!r}"
            )
            assert np.array_equal(self.allowed(matcher, 1 << 20), full), (
                f"{name}: {where}: with a large budget the mask differs from fill_bitmask after {data!r}"
            )
            ids = np.flatnonzero(within).tolist()
            eos = sorted(self.eos & set(ids))
            non_eos = [t for t in ids if t not in self.eos]
            take_eos = eos and (not non_eos or self.rng.random() < EOS_CHANCE)
            token = eos[0] if take_eos else self.pick(non_eos, data, where)
            assert matcher.accept_tokens([token]) == 1, f"{name}: {where}: an allowed token {token} was refused"
            used += 1
            if token in self.eos:
                break
            data += self.token_bytes[token]
            if matcher.is_finished:
                used += 1  # the engine stops here; the EOS it would need counts
                break
        assert used <= budget and case.is_complete(data.decode("utf-8")), (
            f"{name}: {where}: {data!r} after {used} tokens of a budget of {budget} is not a complete output"
        )

    def check_refusals(self) -> None:
        name, kinds = self.cls.name, self.cls.supported_kinds
        examples = {
            ConstraintKind.JSON_SCHEMA: Constraint.json_schema({"type": "string"}),
            ConstraintKind.JSON_OBJECT: Constraint.json_object(),
            ConstraintKind.REGEX: Constraint.regex("a"),
            ConstraintKind.CHOICE: Constraint.choice(["a"]),
            ConstraintKind.EBNF: Constraint.ebnf('root ::= "a"'),
            ConstraintKind.LARK: Constraint.lark('start: "a"'),
        }
        for kind, constraint in examples.items():
            if kind in kinds:
                continue
            try:
                self.backend.compile(constraint)
            except UnsupportedFeatureError as exc:
                assert kind.value in exc.feature, f"{name}: refusing a {kind.value} constraint names {exc.feature!r}"
            else:
                raise AssertionError(f"{name}: compiled a {kind.value} constraint, not in its supported_kinds")
        if ConstraintKind.REGEX in kinds:
            _expect_error(self.backend, Constraint.regex("(unclosed"), GrammarError, f"{name}: an invalid regex")
        if ConstraintKind.JSON_SCHEMA not in kinds:
            return
        _expect_error(self.backend, Constraint.json_schema({"type": "no-such-type"}), GrammarError,
                      f"{name}: a schema of an unknown type")
        for keyword, schema in HARD_SCHEMAS:
            try:
                grammar = self.backend.compile(Constraint.json_schema(schema))
            except UnsupportedFeatureError as exc:
                assert keyword in exc.feature, f"{name}: refusing {schema} names {exc.feature!r}, not {keyword!r}"
                continue
            case = _Case(Constraint.json_schema(schema), _schema_check(schema), False)
            for i in range(self.num_walks):
                self.walk(grammar, case, f"{keyword} walk {i}")


def _is_utf8_prefix(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 but perhaps for an unfinished last character
    (Python's incremental decoder waits for a whole character before judging it)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data" and exc.end == len(data)
    return True


def _expect_error(backend: BaseGrammarBackend, constraint: Constraint, error: type[Exception], what: str) -> None:
    try:
        backend.compile(constraint)
    except error:
        return
    raise AssertionError(f"{what} ({constraint.describe()}) compiled; expected {error.__name__}")


def check_grammar_backend(
    cls: type[BaseGrammarBackend],
    tokenizer=None,
    vocab_size: int | None = None,
    eos_token_ids: tuple[int, ...] | None = None,
    num_walks: int = 8,
    seed: int = 0,
    strict_utf8: bool = True,
) -> None:
    """Check ``cls`` against the contract, on ``tokenizer`` (default: the tiny
    byte-level tokenizer of `ember.testing.tiny_models`, its model vocabulary padded
    past the tokenizer's). ``vocab_size`` defaults to the tokenizer's length,
    ``eos_token_ids`` to its EOS.

    ``strict_utf8=False`` is for a backend whose masks may allow bytes that are not
    valid UTF-8 (xgrammar admits encoded surrogates): the walks then pick only tokens
    that keep the output valid UTF-8 instead of failing on the others. Say so in the
    backend's documentation."""
    assert isinstance(cls, type) and issubclass(cls, BaseGrammarBackend), f"{cls!r} is not a BaseGrammarBackend"
    assert isinstance(getattr(cls, "name", None), str) and cls.name, f"{cls.__name__}.name must be a non-empty str"
    kinds = getattr(cls, "supported_kinds", None)
    assert isinstance(kinds, frozenset) and kinds and all(isinstance(k, ConstraintKind) for k in kinds), (
        f"{cls.name}: supported_kinds must be a non-empty frozenset of ConstraintKind"
    )
    assert isinstance(cls.max_rollback_tokens, int) and cls.max_rollback_tokens >= 16, (
        f"{cls.name}: max_rollback_tokens must be an int >= 16"
    )
    if tokenizer is None:
        from ember.testing.tiny_models import VOCAB_SIZE, byte_tokenizer

        tokenizer = byte_tokenizer()
        vocab_size = vocab_size or VOCAB_SIZE
    vocab_size = vocab_size or len(tokenizer)
    eos_token_ids = eos_token_ids or (tokenizer.eos_token_id,)
    checker = _Checker(cls, GrammarContext(tokenizer, vocab_size, tuple(eos_token_ids)), num_walks, seed,
                       strict_utf8)
    checker.check_cases()
    checker.check_serialization()
    checker.check_budget()
    checker.check_refusals()
