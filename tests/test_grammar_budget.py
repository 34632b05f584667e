"""Constrained outputs that always close (docs/grammar.md): the token distances of
outlines-core's index on hand-made regexes, budget masks, the conformance check's budget
walks (and a planted defect it must catch), the repetition bound, the engine on a tiny
random Llama closing JSON at small max_tokens (and not, with the flags off), and the
grammar applied after a reasoning span."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from tiny_models import VOCAB_SIZE, byte_tokenizer

from ember import LLM, SamplingParams
from ember.constraint import Constraint
from ember.engine.grammar_guard import GuardedMatcher, GuardSettings, Vocab, repeating_token
from ember.plugin import create_plugin_manager, hookimpl
from ember.plugin.grammar import GrammarContext
from ember.plugin.logits_processor import BaseLogitsProcessor
from ember.plugins.grammar import token_distance
from ember.plugins.grammar.outlines_backend import OutlinesBackend, OutlinesGrammar, OutlinesMatcher
from ember.plugins.grammar.xgrammar_backend import XGrammarBackend
from ember.sampling_params import ReasoningSpan
from ember.testing import check_grammar_backend


@pytest.fixture(scope="module")
def context():
    tokenizer = byte_tokenizer()
    return GrammarContext(tokenizer, VOCAB_SIZE, (tokenizer.eos_token_id,))


@pytest.fixture(scope="module")
def outlines(context):
    return OutlinesBackend(context)


def allowed_text(context, fill) -> set[bytes]:
    """The tokens a row allows, as their bytes (EOS as b'<eos>')."""
    bitmask = torch.full((1, context.num_mask_words), -1, dtype=torch.int32)
    fill(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=context.vocab_size, bitorder="little")[0]
    return {context.token_bytes[t] or b"<eos>" for t in np.flatnonzero(bits)}


def walk(matcher, context, text: bytes) -> None:
    ids = [context.token_bytes.index(bytes([b])) for b in text]
    assert matcher.accept_tokens(ids) == len(ids)


# -- distances -------------------------------------------------------------------------
@pytest.mark.parametrize("regex, prefix, expected", [
    (r"(ab)+c|x{5}", b"", 4),  # "abc" and EOS
    (r"(ab)+c|x{5}", b"x", 5),  # "xxxx" and EOS
    (r"(ab)+c|x{5}", b"aba", 3),  # "bc" and EOS
    (r"[0-9]{3}[a-z]*", b"12", 2),
    (r"[0-9]{3}[a-z]*", b"123", 1),  # may end now
    (r"[0-9]{2}x[0-9]+", b"12x", 2),
    (r'"[a-z]*"', b'"abc', 2),
])
def test_distance_counts_the_fewest_tokens_to_an_end_with_eos(outlines, context, regex, prefix, expected):
    matcher = outlines.compile(Constraint.regex(regex)).create_matcher()
    walk(matcher, context, prefix)
    assert matcher.min_tokens_to_end() == expected


def test_budget_masks_keep_only_tokens_that_still_close(outlines, context):
    matcher = outlines.compile(Constraint.regex(r"(ab)+c|x{5}")).create_matcher()
    assert allowed_text(context, matcher.fill_bitmask) == {b"a", b"x"}
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 6)) == {b"a", b"x"}
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 5)) == {b"a"}  # "xxxxx" and EOS: 6
    walk(matcher, context, b"ab")
    assert allowed_text(context, matcher.fill_bitmask) == {b"a", b"c"}
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 4)) == {b"a", b"c"}
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 3)) == {b"c"}  # "a" then "bc" EOS
    # below the distance nothing fits: a shortest path stays
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 1)) == {b"c"}
    walk(matcher, context, b"c")
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 1)) == {b"<eos>"}


def test_a_free_string_closes_when_the_budget_says_so(outlines, context):
    matcher = outlines.compile(Constraint.regex(r'\{"a":"[a-z]*"\}')).create_matcher()
    walk(matcher, context, b'{"a":"xyz')
    assert matcher.min_tokens_to_end() == 3  # '"', '}', EOS
    assert len(allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 4))) == 27
    assert allowed_text(context, lambda m, r: matcher.fill_bitmask_within(m, r, 3)) == {b'"'}


def test_too_large_an_index_is_not_measured(outlines):
    grammar = outlines.compile(Constraint.regex("[a-z]{3}"))
    index = grammar.index
    assert token_distance.measure(index.get_transitions(), index.get_final_states(), (), max_transitions=10) is None
    assert token_distance.measure(index.get_transitions(), index.get_final_states(), ()) is not None


# -- the conformance check ---------------------------------------------------------------
class _IgnoresBudget(OutlinesMatcher):
    def fill_bitmask_within(self, bitmask, row, tokens_left):
        self.fill_bitmask(bitmask, row)


class _IgnoresBudgetGrammar(OutlinesGrammar):
    def create_matcher(self):
        return _IgnoresBudget(self)


class _IgnoresBudgetBackend(OutlinesBackend):
    name = "ignores-budget"

    def compile(self, constraint):
        grammar = super().compile(constraint)
        grammar.__class__ = _IgnoresBudgetGrammar
        return grammar


def test_conformance_catches_a_matcher_that_ignores_its_budget():
    # (tests/test_grammar.py runs the whole check, budget walks included, on both built-ins)
    with pytest.raises(AssertionError, match="needed after|not a complete output"):
        check_grammar_backend(_IgnoresBudgetBackend, num_walks=3)


# -- the repetition bound ----------------------------------------------------------------
def test_repeating_token_finds_runs_without_json_punctuation(context):
    vocab = Vocab(context.token_bytes, context.eos_token_ids, context.num_mask_words)
    ids = {bytes([b]): context.token_bytes.index(bytes([b])) for b in b'1.234567890a ,"'}

    def tokens(text: bytes) -> list[int]:
        return [ids[bytes([b])] for b in text]

    assert repeating_token(tokens(b"1.1.1.1.1.1."), 12, vocab) == ids[b"1"]
    assert repeating_token(tokens(b"1.1.1.1.1.1"), 12, vocab) is None  # 11 tokens
    assert repeating_token(tokens(b"1.1.1.1.1.1."), 0, vocab) is None  # off
    assert repeating_token(tokens(b"12345678901234567890"), 12, vocab) == ids[b"1"]  # two periods of ten
    assert repeating_token(tokens(b"a" * 12), 12, vocab) == ids[b"a"]
    assert repeating_token(tokens(b" " * 12), 12, vocab) == ids[b" "]  # whitespace runs too
    assert repeating_token(tokens(b"1, 1, 1, 1, 1, "), 12, vocab) is None  # equal array items are structure


def guarded(outlines, context, regex, limit=12, budget=True, max_tokens=1000, span=None):
    vocab = Vocab(context.token_bytes, context.eos_token_ids, context.num_mask_words)
    matcher = outlines.compile(Constraint.regex(regex)).create_matcher()
    return GuardedMatcher(matcher, max_tokens, GuardSettings(budget, limit), vocab, span)


def test_the_repeating_token_is_masked_but_the_string_can_close(outlines, context):
    guard = guarded(outlines, context, r'"[0-9.]*"')
    walk(guard, context, b'"' + b"1." * 6)
    after = allowed_text(context, guard.fill_bitmask)
    assert b"1" not in after and {b'"', b".", b"2"} <= after
    off = guarded(outlines, context, r'"[0-9.]*"', limit=0)
    walk(off, context, b'"' + b"1." * 6)
    assert b"1" in allowed_text(context, off.fill_bitmask)
    forced = guarded(outlines, context, r"(1\.){20}")  # the grammar allows nothing else: it stays
    walk(forced, context, b"1." * 8)
    assert allowed_text(context, forced.fill_bitmask) == {b"1"}


def test_the_guard_counts_tokens_and_rolls_back(outlines, context):
    guard = guarded(outlines, context, r'\{"a":"[a-z]*"\}', max_tokens=12)
    walk(guard, context, b'{"a":"xyz')  # 9 tokens, 3 left: exactly the closing
    assert allowed_text(context, guard.fill_bitmask) == {b'"'}
    guard.rollback(2)
    assert len(allowed_text(context, guard.fill_bitmask)) == 27


# -- the engine --------------------------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"},
                                      "tags": {"type": "array", "items": {"type": "string"}},
                                      "n": {"type": "integer"}}, "required": ["name", "tags", "n"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "geo": {"type": "object", "properties": {"lat": {"type": "number"},
                                                                               "lon": {"type": "number"}},
                                              "required": ["lat", "lon"]}},
     "required": ["city", "zip", "geo"]},
    {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                 "qty": {"type": "integer"}},
                                "required": ["sku", "qty"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "note": {"type": "string"}},
     "required": ["kind", "note"]},
]


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):
    on = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    off = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, block_size=4,
              grammar_budget=False, grammar_repetition_limit=0)
    return on, off


@pytest.mark.parametrize("backend", ["outlines", "xgrammar"])
def test_random_weights_close_json_at_small_max_tokens(llms, backend):
    on, off = llms
    prompts = [f"p{i}" for i in range(len(SCHEMAS) * 3)]
    params = [SamplingParams(temperature=temperature, max_tokens=60, seed=7, constraint=Constraint.json_schema(schema),
                             grammar_backend=backend)
              for schema in SCHEMAS for temperature in (0.0, 0.7, 1.0)]
    schemas = [schema for schema in SCHEMAS for _ in range(3)]
    for out, schema in zip(on.generate(prompts, params), schemas):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and len(completion.token_ids) <= 60
        assert _validates(completion.text, schema), completion.text
    # flags off: the old behaviour, random weights wander in the free strings until max_tokens
    old = [o.outputs[0] for o in off.generate(prompts, params)]
    assert sum(c.finish_reason == "length" and not _validates(c.text, s) for c, s in zip(old, schemas)) >= 6


def test_a_budget_below_any_completion_ends_as_length(llms):
    on, _ = llms
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    out = on.generate("x", SamplingParams(temperature=0, max_tokens=5, constraint=Constraint.json_schema(schema)))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "length" and completion.text == '{"nam'


# -- grammars after reasoning ------------------------------------------------------------
QWEN3 = ReasoningSpan("<think>", "</think>", starts_inside=False)
R1 = ReasoningSpan("<think>", "</think>", starts_inside=True)


def test_the_guard_leaves_reasoning_free_then_starts_the_grammar(outlines, context):
    guard = guarded(outlines, context, r"(yes|no)-[0-9]{2}", span=QWEN3)
    assert allowed_text(context, guard.fill_bitmask) == {b"y", b"n", b"<"}  # the answer, or the opening tag
    walk(guard, context, b"<th")
    assert allowed_text(context, guard.fill_bitmask) == {b"i"}  # half a tag: only the tag goes on
    walk(guard, context, b"ink>Let me think: {} </thin")
    assert len(allowed_text(context, guard.fill_bitmask)) > 200  # reasoning: free
    walk(guard, context, b"k>")
    assert allowed_text(context, guard.fill_bitmask) == {b"y", b"n"}
    walk(guard, context, b"no-4")
    guard.rollback(6)  # back into the reasoning, "</thin" spelt
    walk(guard, context, b"k>yes-12")
    assert guard.is_finished
    direct = guarded(outlines, context, r"(yes|no)-[0-9]{2}", span=QWEN3)
    walk(direct, context, b"n")  # no reasoning: the grammar from the first token
    assert allowed_text(context, direct.fill_bitmask) == {b"o"}
    direct.rollback(1)
    assert allowed_text(context, direct.fill_bitmask) == {b"y", b"n", b"<"}
    inside = guarded(outlines, context, r"(yes|no)-[0-9]{2}", span=R1)
    assert len(allowed_text(context, inside.fill_bitmask)) > 200  # R1 starts inside the reasoning


def test_reasoning_parsers_give_their_span_and_the_api_applies_it():
    from ember.api.structured_outputs import after_reasoning
    from ember.plugin.reasoning_parser import BaseReasoningParser
    from ember.plugins.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

    assert Qwen3ReasoningParser.grammar_span() == QWEN3 and DeepSeekR1ReasoningParser.grammar_span() == R1
    assert BaseReasoningParser.grammar_span() is None  # a parser without it: the grammar from the first token
    params = SamplingParams(constraint=Constraint.regex("a"))
    assert after_reasoning(params, Qwen3ReasoningParser).grammar_after == QWEN3
    assert after_reasoning(params, None) is params
    assert after_reasoning(SamplingParams(), Qwen3ReasoningParser).grammar_after is None
    with pytest.raises(ValueError, match="grammar_after must be None or an ember.sampling_params.ReasoningSpan"):
        SamplingParams(grammar_after="</think>")


class Script(BaseLogitsProcessor):
    """Makes the tiny Llama think: writes the tokens of ``extra["script"]`` first (the
    reasoning a real reasoning model would write), then leaves the model alone."""

    name = "script"

    def apply(self, logits, rows):
        for i, row in enumerate(rows):
            script = self.context.tokenizer.encode(row.params.extra["script"], add_special_tokens=False)
            if row.num_output_tokens < len(script):
                logits[i] = float("-inf")
                logits[i, script[row.num_output_tokens]] = 0.0
        return logits


class ScriptPlugin:
    @hookimpl
    def ember_register_logits_processors(self, registry):
        registry.register(Script.name, Script)


@pytest.fixture(scope="module")
def scripted_llm(tiny_llama_dir):
    pm = create_plugin_manager(extra_plugins=[("script-test", ScriptPlugin())])
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, block_size=4, plugin_manager=pm)


@pytest.mark.parametrize("span, script", [
    (QWEN3, "<think>hm, {yes}?</think>"), (R1, "hm, {no}</think>"), (QWEN3, "no"),  # no reasoning: grammar at once
])
def test_the_engine_constrains_the_answer_after_the_reasoning(scripted_llm, span, script):
    from ember.plugins.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

    regex = r"(yes|no)-[0-9]{2}"
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=60, constraint=Constraint.regex(regex),
                            grammar_after=span, extra={"script": script})
    completion = scripted_llm.generate("q", params)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.text.startswith(script), completion
    parser = Qwen3ReasoningParser if span is QWEN3 else DeepSeekR1ReasoningParser
    reasoning, content = parser().extract(completion.text)
    assert re.fullmatch(regex, content), completion.text
    assert reasoning == (script.removeprefix("<think>").removesuffix("</think>") if "</think>" in script else None)


# -- xgrammar ------------------------------------------------------------------------------
@pytest.mark.parametrize("data, accepted", [
    (b'"\xe0\x99\xad', False),  # an overlong encoding (SmolLM2 wrote one under a maxLength)
    (b'"\xc0\xaf', False),
    (b'"\xed\xa0\x80', False),  # a surrogate
    ('"é€😀"'.encode(), True),  # three characters, 2, 3 and 4 bytes long
    (b'"abcd', False),  # maxLength counts characters
])
def test_xgrammar_bounded_strings_are_utf8_counted_in_characters(context, data, accepted):
    schema = Constraint.json_schema({"type": "string", "maxLength": 3})
    matcher = XGrammarBackend(context).compile(schema).create_matcher()
    ids = [context.token_bytes.index(bytes([b])) for b in data]
    assert (matcher.accept_tokens(ids) == len(ids)) is accepted


# -- the flags -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, environ, budget, limit", [
    ([], {}, True, 12),
    (["--disable-grammar-budget", "--grammar-repetition-limit", "0"], {}, False, 0),
    ([], {"EMBER_DISABLE_GRAMMAR_BUDGET": "1", "EMBER_GRAMMAR_REPETITION_LIMIT": "5"}, False, 5),
])
def test_flags_and_variables_reach_the_engine_config(argv, environ, budget, limit):
    from ember.api.cli import build_parser
    from ember.api.cli_env import apply_defaults
    from ember.api.settings import ServerSettings, engine_config_kwargs
    from ember.config import EngineConfig

    args = build_parser().parse_args(["serve", *argv])
    apply_defaults(args, environ)
    assert (args.disable_grammar_budget, args.grammar_repetition_limit) == (not budget, limit)
    settings = ServerSettings(grammar_repetition_limit=args.grammar_repetition_limit,
                              disable_grammar_budget=args.disable_grammar_budget)
    kwargs = engine_config_kwargs(settings)
    assert (kwargs["grammar_budget"], kwargs["grammar_repetition_limit"]) == (budget, limit)
    config = EngineConfig(model="m", grammar_budget=budget, grammar_repetition_limit=limit)
    assert (config.grammar_budget, config.grammar_repetition_limit) == (budget, limit)


def test_a_negative_repetition_limit_is_refused_naming_it():
    from ember.api.settings import ServerSettings
    from ember.config import EngineConfig

    with pytest.raises(ValueError, match="--grammar-repetition-limit must be an integer >= 0"):
        ServerSettings(grammar_repetition_limit=-1)
    with pytest.raises(ValueError, match="grammar_repetition_limit must be an integer >= 0"):
        EngineConfig(model="m", grammar_repetition_limit=True)
