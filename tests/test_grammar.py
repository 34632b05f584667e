"""Grammar-guided decoding: the contract's values, the vocabulary decoding, both
built-in backends through the conformance check (and planted defects it must catch),
and the engine on a tiny random Llama: constrained outputs under greedy and seeded
sampling, a compile error or timeout ending only its request, preemption, draft
tokens, parallel sampling, aborts and the manager's counters. tests/test_grammar_smollm2.py
runs the real model over many schemas."""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
from tiny_models import VOCAB_SIZE, byte_tokenizer
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from ember import LLM, SamplingParams
from ember.config import SpeculativeConfig
from ember.constraint import Constraint, ConstraintKind
from ember.engine.speculative import SpeculativeDecoder
from ember.plugin import create_plugin_manager
from ember.plugin.grammar import GrammarContext, GrammarError, UnsupportedFeatureError
from ember.plugin.grammar_vocab import decode_token_bytes
from ember.plugin.speculator import BaseSpeculator, Proposal, SpeculatorContext
from ember.plugins.grammar.outlines_backend import OutlinesBackend, OutlinesMatcher
from ember.plugins.grammar.xgrammar_backend import XGrammarBackend
from ember.testing import check_grammar_backend

BACKENDS = {"outlines": OutlinesBackend, "xgrammar": XGrammarBackend}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "adult": {"type": "boolean"},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["name", "adult", "tags"],
}  # a finite language: every output completes within max_tokens
REGEX = r"(yes|no)-[0-9]{2,3}"
CHOICES = ["red", "green", "dark blue"]


@pytest.fixture(scope="module")
def byte_context():
    tokenizer = byte_tokenizer()
    return GrammarContext(tokenizer, VOCAB_SIZE, (tokenizer.eos_token_id,))


# -- the contract's values -------------------------------------------------------------
def test_constraints_are_plain_hashable_values():
    a = Constraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = Constraint.json_schema('{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b) and pickle.loads(pickle.dumps(a)) == a
    assert list(a.schema["properties"]) == ["b", "a"]  # the caller's order: the order of generation
    assert Constraint.choice(["x", "y"]) == Constraint(ConstraintKind.CHOICE, ("x", "y"))
    assert Constraint.json_object().schema == {"type": "object"}
    params = SamplingParams(constraint=Constraint.regex("a+"), grammar_backend="xgrammar")
    assert pickle.loads(pickle.dumps(params)) == params


@pytest.mark.parametrize("make, message", [
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "must be an object, got [1, 2]"),
    (lambda: Constraint.regex(""), "non-empty string, got ''"),
    (lambda: Constraint.choice("yes"), "list of strings, got 'yes'"),
    (lambda: Constraint.choice(["a", ""]), "non-empty strings, got ('a', '')"),
    (lambda: SamplingParams(constraint={"type": "object"}), "got {'type': 'object'}"),
    (lambda: SamplingParams(grammar_backend=""), "grammar_backend must be None or a backend name, got ''"),
])
def test_bad_constraints_are_refused_naming_the_value(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


def test_unsupported_feature_errors_survive_pickling():
    error = UnsupportedFeatureError("outlines", "JSON schema keyword 'minimum' (at /)", "; hint")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.backend, copy.feature, str(copy)) == (error.backend, error.feature, str(error))


# -- the vocabulary ------------------------------------------------------------------
def test_byte_level_tokens_decode_to_their_bytes_and_padding_to_none(byte_context):
    tokenizer = byte_context.tokenizer
    table = byte_context.token_bytes
    assert len(table) == VOCAB_SIZE > len(tokenizer)
    assert all(entry is None for entry in table[len(tokenizer):])  # the model's padding ids
    assert all(table[i] is None for i in tokenizer.all_special_ids)
    text = "héllo {\"ключ\": 1}\n\t🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode()


def test_sentencepiece_tokens_decode_spaces_and_byte_fallback():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁a": 3, "b": 4, "<0x0A>": 5, "<0xC3>": 6, "<0xA9>": 7, "▁": 8}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    table = decode_token_bytes(fast, 12, (2,))
    assert table[:9] == [None, None, None, b" a", b"b", b"\n", b"\xc3", b"\xa9", b" "]
    assert table[9:] == [None] * 3


def test_a_tokenizer_of_unknown_alphabet_is_refused():
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    with pytest.raises(ValueError, match=r"cannot tell the bytes .*WordPiece"):
        decode_token_bytes(fast, 2)


# -- the backends --------------------------------------------------------------------
def test_both_backends_are_registered_through_entry_points():
    registry = create_plugin_manager().registries.grammar_backends
    assert registry.get("outlines") is OutlinesBackend and registry.owner("outlines") == "grammar_outlines"
    assert registry.get("xgrammar") is XGrammarBackend and registry.owner("xgrammar") == "grammar_xgrammar"


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_conforms(name):
    # xgrammar's UTF-8 automaton admits encoded surrogates: its walks keep to valid UTF-8
    check_grammar_backend(BACKENDS[name], strict_utf8=name == "outlines")


class EosAnywhere(OutlinesBackend):
    """A planted defect: EOS allowed in every state."""

    def compile(self, constraint):
        grammar = super().compile(constraint)
        create = grammar.create_matcher

        def create_matcher():
            matcher = create()
            fill = matcher.fill_bitmask

            def fill_with_eos(bitmask, row):
                fill(bitmask, row)
                bitmask[row, self.context.eos_token_ids[0] // 32] |= 1 << (self.context.eos_token_ids[0] % 32)

            matcher.fill_bitmask = fill_with_eos
            return matcher

        grammar.create_matcher = create_matcher
        return grammar


class NoRollback(OutlinesBackend):
    """A planted defect: rollback does nothing."""

    def compile(self, constraint):
        grammar = super().compile(constraint)
        create = grammar.create_matcher

        def create_matcher():
            matcher = create()
            matcher.rollback = lambda num_tokens: None
            return matcher

        grammar.create_matcher = create_matcher
        return grammar


class IgnoresMinimum(OutlinesBackend):
    """A planted defect: compiles `minimum` and `maximum` without enforcing them, as
    outlines-core itself would."""

    def to_regex(self, constraint):
        from outlines_core.json_schema import build_regex_from_schema

        schema = constraint.schema if constraint.kind is ConstraintKind.JSON_SCHEMA else None
        if schema is not None and "minimum" in schema:
            return build_regex_from_schema(json.dumps(schema))
        return super().to_regex(constraint)


@pytest.mark.parametrize("defect, message", [
    (EosAnywhere, "EOS allowed after"),
    (NoRollback, "after rolling back"),
    (IgnoresMinimum, "is not complete"),
])
def test_conformance_catches_planted_defects(defect, message):
    with pytest.raises(AssertionError, match=message):
        check_grammar_backend(defect)


@pytest.mark.parametrize("name, schema, feature", [
    ("outlines", {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}},
     "JSON schema keyword 'minimum' (at /properties/age)"),
    ("outlines", {"type": "string", "maxLength": 4, "pattern": "^a+$"}, "'maxLength' together with 'pattern'"),
    ("outlines", {"type": "string", "format": "ipv4"}, "string format 'ipv4' (at /)"),
    ("xgrammar", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "JSON schema keyword 'oneOf' (at /)"),
    ("xgrammar", {"$defs": {"n": {"type": "number", "multipleOf": 0.5}}}, "'multipleOf' outside an integer schema"),
    ("xgrammar", {"type": "array", "items": {"enum": [1, 2], "title": "x", "minimum": 1}},
     "'minimum' beside 'enum' in one schema (at /items)"),
])
def test_unsupported_schema_features_are_named(byte_context, name, schema, feature):
    with pytest.raises(UnsupportedFeatureError) as info:
        BACKENDS[name](byte_context).compile(Constraint.json_schema(schema))
    assert feature in info.value.feature and info.value.backend == name


def test_outlines_refuses_grammars_and_xgrammar_compiles_them(byte_context):
    grammar = Constraint.ebnf('root ::= "a" [0-9]')
    with pytest.raises(UnsupportedFeatureError, match="does not support ebnf constraints"):
        OutlinesBackend(byte_context).compile(grammar)
    matcher = XGrammarBackend(byte_context).compile(grammar).create_matcher()
    assert matcher.accept_tokens(byte_context.tokenizer.encode("a7", add_special_tokens=False)) == 2
    assert matcher.is_finished
    with pytest.raises(GrammarError, match="xgrammar cannot compile ebnf"):
        XGrammarBackend(byte_context).compile(Constraint.ebnf("root ::= undefined_rule"))


def test_the_outlines_matcher_walks_with_the_guide_only(byte_context):
    grammar = OutlinesBackend(byte_context).compile(Constraint.choice(["ab", "abc"]))
    matcher = grammar.create_matcher()
    assert isinstance(matcher, OutlinesMatcher)
    a, b, c = byte_context.tokenizer.encode("abc", add_special_tokens=False)
    assert matcher.accept_tokens([a, b]) == 2 and not matcher.is_finished  # "abc" may follow
    assert matcher.accept_tokens([c, a]) == 1 and matcher.is_finished


def _accepts_whole(backend, constraint: Constraint, text: str, context) -> bool:
    """Whether ``text`` followed by EOS is a complete output of ``constraint``."""
    matcher = backend(context).compile(constraint).create_matcher()
    tokens = context.tokenizer.encode(text, add_special_tokens=False) + [context.eos_token_ids[0]]
    return matcher.accept_tokens(tokens) == len(tokens)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fmt, good, bad", [
    ("date", ["2024-01-31", "1999-12-30", "2023-02-28"],
     ["2023-02-31", "2023-04-31", "20230-01-01", "2023-1-01", "2023-00-10"]),
    ("time", ["23:59:59Z", "08:30:00.123456789+02:00", "00:00:00-11:30"],
     ["24:00:00Z", "08:30:00", "08:30:00.1234567890Z", "08:30Z"]),
    ("date-time", ["2023-07-01T13:21:23Z", "2023-07-01T13:21:23.5+05:30"],
     ["20230701132123300252-07-01T13:21:23Z", "2023-07-01T13:21:23", "2023-02-30T00:00:00Z",
      "2023-07-01 13:21:23Z"]),
])
def test_dates_and_times_follow_rfc_3339_on_both_backends(byte_context, name, fmt, good, bad):
    """outlines-core's own date-time admits a year of any length (SmolLM2 sampled digits
    there until max_tokens) and its date 31 February; both backends compile these
    formats as RFC 3339 patterns with real days and a bounded fraction."""
    constraint = Constraint.json_schema({"type": "object", "properties": {"at": {"type": "string", "format": fmt}},
                                         "required": ["at"]})
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for text in good:
        assert _accepts_whole(BACKENDS[name], constraint, json.dumps({"at": text}), byte_context), text
        assert checker.conforms(text, fmt) or fmt != "date", text
    for text in bad:
        assert not _accepts_whole(BACKENDS[name], constraint, json.dumps({"at": text}), byte_context), text


# -- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, block_size=4)


def _matches(constraint: Constraint, text: str) -> bool:
    if constraint.kind is ConstraintKind.REGEX:
        return re.fullmatch(constraint.value, text) is not None
    if constraint.kind is ConstraintKind.CHOICE:
        return text in constraint.value
    try:
        jsonschema.validate(json.loads(text), constraint.schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


CONSTRAINTS = [Constraint.json_schema(PERSON), Constraint.regex(REGEX), Constraint.choice(CHOICES),
               Constraint.json_object()]
PROMPTS = ["Tell me about", "hello", "x", "The answer is", "{", "A list:"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_always_match_their_constraint(llm, backend, temperature):
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=160, constraint=c, grammar_backend=backend)
        for i, c in enumerate(CONSTRAINTS) for _ in PROMPTS
    ]
    outs = llm.generate(PROMPTS * len(CONSTRAINTS), params)
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        if completion.finish_reason == "length":  # json_object may nest past max_tokens at random
            assert p.constraint.kind is ConstraintKind.JSON_OBJECT, completion.text
            continue
        assert completion.finish_reason == "stop", (completion.finish_reason, completion.error)
        assert _matches(p.constraint, completion.text), (p.constraint.describe(), completion.text)


def test_a_completed_grammar_ends_the_request_without_eos(llm):
    # the tiny model never picks EOS (its special rows are zero): the grammar ends it
    out = llm.generate("pick one", SamplingParams(temperature=0, max_tokens=50, constraint=Constraint.choice(
        ["alpha", "beta"])))[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop" and out.stop_reason is None
    assert len(out.token_ids) < 50


def test_a_grammar_error_ends_only_its_request(llm):
    good = SamplingParams(temperature=0, max_tokens=12)
    bad_schema = SamplingParams(max_tokens=12, constraint=Constraint.json_schema({"type": "integer", "minimum": 1}),
                                grammar_backend="outlines")
    bad_regex = SamplingParams(max_tokens=12, constraint=Constraint.regex("(unclosed"), grammar_backend="xgrammar")
    reference = llm.generate(["one", "two"], good)
    outs = llm.generate(["one", "x", "y", "two"], [good, bad_schema, bad_regex, good])
    assert [o.outputs[0].token_ids for o in (outs[0], outs[3])] == [o.outputs[0].token_ids for o in reference]
    schema_error, regex_error = outs[1].outputs[0], outs[2].outputs[0]
    assert schema_error.finish_reason == "error" and schema_error.token_ids == []
    assert "grammar backend 'outlines' does not support JSON schema keyword 'minimum' (at /)" in schema_error.error
    assert regex_error.finish_reason == "error"
    assert "xgrammar cannot compile regex '(unclosed'" in regex_error.error
    assert outs[0].outputs[0].error is None
    assert not llm.engine.has_unfinished_requests()


def test_a_compile_past_the_timeout_ends_its_request(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, grammar_compile_timeout_s=1e-3)
    # outlines takes far longer than a millisecond over this many bounded strings
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 30} for i in range(12)}}
    outs = llm.generate(["a", "b"], [
        # the other request samples unseeded at temperature 1: ignore_eos, or an early end of
        # text on the random tiny model (seen once in 1189 tests) finishes it "stop"
        SamplingParams(max_tokens=8, constraint=Constraint.json_schema(schema)),
        SamplingParams(max_tokens=8, ignore_eos=True),
    ])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "took longer than 0.001 s (--grammar-compile-timeout, grammar_compile_timeout_s)" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length"
    assert llm.engine.grammar.num_compile_timeouts == 1


def test_unknown_backends_and_kinds_are_refused_at_once(llm):
    with pytest.raises(ValueError, match="unknown grammar backend 'nope'; registered: outlines, xgrammar"):
        llm.generate("a", SamplingParams(constraint=Constraint.regex("a"), grammar_backend="nope"))
    with pytest.raises(ValueError, match="'outlines' does not support lark constraints"):
        llm.generate("a", SamplingParams(constraint=Constraint.lark('start: "a"'), grammar_backend="outlines"))
    assert not llm.engine.has_unfinished_requests()


def test_what_the_default_backend_refuses_falls_back_when_no_backend_is_named(llm):
    ranged = Constraint.json_schema({"type": "integer", "minimum": 3, "maximum": 7})
    lark = Constraint.lark('start: "(" DIGIT ")"\n%import common.DIGIT')
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=8, constraint=c) for c in (ranged, lark)])
    assert 3 <= int(outs[0].outputs[0].text) <= 7
    assert re.fullmatch(r"\(\d\)", outs[1].outputs[0].text)
    named = llm.generate("a", SamplingParams(max_tokens=8, constraint=ranged, grammar_backend="outlines"))[0]
    assert named.outputs[0].finish_reason == "error"  # the fallback's grammar does not answer a named backend


def test_compiles_are_cached_and_counted(llm):
    grammar = llm.engine.grammar
    constraint = Constraint.regex("[0-9]{4}-cached")
    before = (grammar.num_compiles, grammar.num_cache_hits)
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=20, constraint=constraint))
    assert all(re.fullmatch(constraint.value, o.outputs[0].text) for o in outs)
    assert (grammar.num_compiles, grammar.num_cache_hits) == (before[0] + 1, before[1] + 2)
    assert grammar.compile_time_s > 0 and not grammar.matchers


def test_preempted_grammar_requests_resume_where_they_were(tiny_llama_dir, llm):
    prompts = [f"request number {i} says" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=120, constraint=Constraint.json_schema(PERSON))
    reference = [o.outputs[0] for o in llm.generate(prompts, params)]
    small = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=40, block_size=4)
    got = [o.outputs[0] for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert [c.text for c in got] == [c.text for c in reference]
    assert all(c.finish_reason == "stop" and _matches(params.constraint, c.text) for c in got)


class GreedySpeculator(BaseSpeculator):
    """Proposes the known greedy continuation with every other draft corrupted
    (outside the grammar, often), so masks walk accepted and refused drafts."""

    name = "greedy-oracle"

    def __init__(self, continuations: dict[tuple, list[int]], k: int = 3) -> None:
        super().__init__(SpeculatorContext(SpeculativeConfig(self.name, k), 1 << 20, ()))
        self.continuations, self.k, self.calls = continuations, k, 0

    def propose(self, requests):
        proposals = []
        for r in requests:
            self.calls += 1
            truth = self.continuations[tuple(r.prompt_token_ids)]
            n = len(r.output_token_ids)
            draft = list(truth[n : n + self.k])
            if self.calls % 2 and draft:
                draft[-1] = (draft[-1] + 7) % 256
            proposals.append(Proposal(draft))
        return proposals

    def decoder(self) -> SpeculativeDecoder:
        # every step drafts (cost_aware off: this checks the masks, not whether drafting pays)
        return SpeculativeDecoder(self, SpeculativeConfig(self.name, self.k, disable_by_batch_size=None,
                                                          min_acceptance_rate=0.0, cost_aware=False))


def test_draft_tokens_are_masked_and_rolled_back(llm):
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in ["draft one", "draft two", "three"]]
    params = SamplingParams(temperature=0, max_tokens=100, constraint=Constraint.json_schema(PERSON))
    reference = llm.generate(prompt_token_ids=ids, sampling_params=params)
    llm.engine.core.speculator = GreedySpeculator(
        {tuple(i): o.outputs[0].token_ids for i, o in zip(ids, reference)}
    ).decoder()
    try:
        got = llm.generate(prompt_token_ids=ids, sampling_params=params)
    finally:
        llm.engine.core.speculator = None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]


def test_parallel_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40, constraint=Constraint.regex(REGEX))
    out = llm.generate("several", params)[0]
    assert len(out.outputs) == 3
    assert all(re.fullmatch(REGEX, c.text) for c in out.outputs)


def test_aborting_a_request_that_waits_for_its_grammar(llm):
    engine = llm.engine
    request_id = engine.add_request("a", SamplingParams(constraint=Constraint.regex("[a-z]{3}-aborted")))
    assert request_id in engine.core.grammar.waiting
    assert engine.abort_request(request_id)
    assert not engine.has_unfinished_requests() and not engine.core.grammar.waiting
