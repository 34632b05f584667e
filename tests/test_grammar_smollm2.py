"""Structured outputs on the real default model (SmolLM2-135M-Instruct): 24 JSON
schemas, 3 regexes and 3 choices, each under greedy decoding and seeded temperature
0.8, all in one continuous batch. The default backend (outlines) runs every constraint
it can express; the four schemas with ranges and multiples, which it refuses naming
the keyword, run on xgrammar, chosen per request in the same batch. Every output must
parse and validate (``jsonschema`` with its format checker) or match. The model is
small: the content may be poor, the structure may not. Both backends then pass the
conformance check on SmolLM2's tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ember import LLM, SamplingParams
from ember.constraint import Constraint, ConstraintKind

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}, "email": {
        "type": "string", "format": "email"}}, "required": ["name", "age", "email"]},
    "address": {"type": "object", "properties": {"name": NAME, "address": {"type": "object", "properties": {
        "street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"]}}, "required": ["name", "address"]},
    "hobbies": {"type": "object", "properties": {"hobbies": {"type": "array", "items": NAME, "minItems": 2,
                                                             "maxItems": 4}}, "required": ["hobbies"]},
    "color": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "id_or_name": {"type": "object", "properties": {"key": {"anyOf": [{"type": "integer"}, NAME]}},
                   "required": ["key"]},
    "flags": {"type": "object", "properties": {"done": {"type": "boolean"}, "urgent": {"type": "boolean"},
                                               "note": NAME}, "required": ["done"]},
    "event": {"type": "object", "properties": {"event": NAME, "date": {"type": "string", "format": "date"}},
              "required": ["event", "date"]},
    "record": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}, "label": NAME},
               "required": ["id", "label"]},
    "order": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": NAME, "qty": {"type": "integer"}}, "required": ["name", "qty"]}}},
        "required": ["items"]},
    "phone": {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
              "required": ["phone"]},
    "book": {"type": "object", "properties": {"kind": {"const": "book"}, "title": NAME, "pages": {"type": "integer"}},
             "required": ["kind", "title"]},
    "nullable": {"type": "object", "properties": {"nickname": {"anyOf": [NAME, {"type": "null"}]}, "name": NAME},
                 "required": ["nickname", "name"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"]},
    "small_ints": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    "int_list": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
    "recipe": {"type": "object", "properties": {"title": NAME, "ingredients": {"type": "array", "items": NAME,
               "minItems": 1, "maxItems": 5}, "minutes": {"type": "integer"}}, "required": ["title", "ingredients"]},
    "meeting": {"type": "object", "properties": {"topic": NAME, "at": {"type": "string", "format": "date-time"}},
                "required": ["topic", "at"]},
    "optional_only": {"type": "object", "properties": {"a": NAME, "b": {"type": "boolean"}}},
    "pet": {"type": "object", "properties": {"pet": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "breed": NAME}, "required": ["kind", "breed"]},
    ]}}, "required": ["pet"]},
    # ranges and multiples: xgrammar enforces them, outlines refuses them by name
    "rating": {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                "comment": NAME}, "required": ["stars", "comment"]},
    "weather": {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                                                 "city": NAME}, "required": ["celsius", "city"]},
    "dozen": {"type": "object", "properties": {"eggs": {"type": "integer", "multipleOf": 12, "minimum": 12,
                                                        "maximum": 144}}, "required": ["eggs"]},
    "price": {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0}, "item": NAME},
              "required": ["price", "item"]},
}
REFUSED_BY_OUTLINES = {"rating": "'minimum'", "weather": "'minimum'", "dozen": "'multipleOf'",
                       "price": "'exclusiveMinimum'"}
REGEXES = [r"[0-9]{3}-[0-9]{3}-[0-9]{4}", r"(Mon|Tues|Wednes|Thurs|Fri)day at [0-9]{1,2}(am|pm)",
           r"[A-Z][a-z]{1,12} is [0-9]{1,3} years old"]
CHOICES = [["positive", "negative", "neutral"], ["yes", "no"], ["Paris", "London", "Berlin", "Rome"]]


def _prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32")


def test_every_structured_output_parses_and_validates(llm):
    tokenizer = llm.get_tokenizer()
    cases: list[tuple[str, str, Constraint]] = []  # (name, prompt, constraint)
    for name, schema in SCHEMAS.items():
        text = f"Reply with a JSON object for a {name.replace('_', ' ')}."
        cases.append((name, text, Constraint.json_schema(schema)))
    cases += [("regex", "Give a phone number.", Constraint.regex(REGEXES[0])),
              ("regex", "When do we meet?", Constraint.regex(REGEXES[1])),
              ("regex", "Describe someone's age in one sentence.", Constraint.regex(REGEXES[2])),
              ("choice", "Is this review positive? 'I loved it.'", Constraint.choice(CHOICES[0])),
              ("choice", "Is the sky blue?", Constraint.choice(CHOICES[1])),
              ("choice", "What is the capital of France?", Constraint.choice(CHOICES[2]))]
    prompts, params, names = [], [], []
    for i, (name, text, constraint) in enumerate(cases):
        refused = REFUSED_BY_OUTLINES.get(name)
        runs = [("outlines", 0.0)] + [("xgrammar", t) for t in (0.0, 0.8)] if refused else \
            [("outlines", t) for t in (0.0, 0.8)]
        for backend, temperature in runs:
            prompts.append(_prompt(tokenizer, text))
            names.append(name)
            params.append(SamplingParams(temperature=temperature, seed=100 + i, max_tokens=120,
                                         constraint=constraint, grammar_backend=backend))
    outs = llm.generate(prompts, params)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    num_checked = 0
    for out, p, name in zip(outs, params, names):
        completion, constraint = out.outputs[0], p.constraint
        if p.grammar_backend == "outlines" and name in REFUSED_BY_OUTLINES:
            assert completion.finish_reason == "error", completion
            assert f"'outlines' does not support JSON schema keyword {REFUSED_BY_OUTLINES[name]}" in completion.error
            continue
        assert completion.finish_reason == "stop", (name, completion.finish_reason, completion.error, completion.text)
        text = completion.text
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            jsonschema.validate(json.loads(text), constraint.schema, format_checker=checker)
        elif constraint.kind is ConstraintKind.REGEX:
            assert re.fullmatch(constraint.value, text), (constraint.value, text)
        else:
            assert text in constraint.value, (constraint.value, text)
        num_checked += 1
    assert num_checked == 2 * len(cases)


def test_the_real_tokenizer_conforms(llm):
    from ember.plugins.grammar.outlines_backend import OutlinesBackend
    from ember.plugins.grammar.xgrammar_backend import XGrammarBackend
    from ember.testing import check_grammar_backend

    vocab_size = llm.engine.hf_config.vocab_size
    eos = tuple(llm.engine.eos_token_ids)
    check_grammar_backend(OutlinesBackend, llm.get_tokenizer(), vocab_size, eos, num_walks=4)
    check_grammar_backend(XGrammarBackend, llm.get_tokenizer(), vocab_size, eos, num_walks=4, strict_utf8=False)
