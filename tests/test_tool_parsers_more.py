"""The tool-call parsers beyond hermes and llama3_json (issue 33 item 6): each passes the
conformance check, reads its syntax whole and fed in random chunkings (several calls,
arguments as JSON objects), keeps malformed calls as text, and is chosen by its template."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from ember.engine.tool_calls import select_tool_parser
from ember.plugin import create_plugin_manager
from ember.plugin.tool_parser import assemble
from ember.plugins.tool_parsers.granite import GraniteToolParser
from ember.plugins.tool_parsers.mistral import MistralToolParser
from ember.plugins.tool_parsers.pythonic import PythonicToolParser
from ember.plugins.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from ember.testing import check_tool_parser


def _chunked(parser_cls, text, seed):
    rng = random.Random(seed)
    parser, deltas, i = parser_cls(), [], 0
    while i < len(text):
        step = rng.randint(1, 9)
        deltas.append(parser.feed(text[i : i + step]))
        i += step
    deltas.append(parser.finish())
    return assemble(deltas)


def _read(parser_cls, text):
    """The message read whole, checked to read the same in 30 random chunkings."""
    whole = parser_cls().parse(text)
    summary = (whole.content, [(c.name, json.loads(c.arguments)) for c in whole.tool_calls])
    for seed in range(30):
        fed = _chunked(parser_cls, text, seed)
        assert (fed.content, [(c.name, json.loads(c.arguments)) for c in fed.tool_calls]) == summary, (seed, text)
    return summary


# -- mistral ------------------------------------------------------------------------
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}[TOOL_CALLS][{{ calls }}]{% endif %}[AVAILABLE_TOOLS]"


def test_mistral_conforms_and_is_chosen_by_its_template():
    check_tool_parser(MistralToolParser)
    registry = create_plugin_manager().registries.tool_parsers
    assert registry.owner("mistral") == "tool_parser_mistral"
    assert select_tool_parser(registry, MISTRAL_TEMPLATE) is MistralToolParser


@pytest.mark.parametrize(("text", "expected"), [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
     '{"name": "other", "arguments": {"x": 1, "y": [true, null]}}]',
     (None, [("get_weather", {"city": "Paris", "unit": "c"}), ("other", {"x": 1, "y": [True, None]})])),
    ('Checking. [TOOL_CALLS] [{"name": "ping", "arguments": {}}]', ("Checking. ", [("ping", {})])),
    ('[TOOL_CALLS][{"name": "f"}]', (None, [("f", {})])),
    ("[TOOL_CALLS]not a call", ("[TOOL_CALLS]not a call", [])),
    ('[TOOL_CALLS][{"arguments": {"a": 1}}]', ('[TOOL_CALLS][{"arguments": {"a": 1}}]', [])),
    ("[TOOL_CALL] is not the marker", ("[TOOL_CALL] is not the marker", [])),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]other[ARGS]{"x": {"y": "]"}}',
     (None, [("get_weather", {"city": "Paris", "unit": "c"}), ("other", {"x": {"y": "]"}})])),
    ('Sure. [TOOL_CALLS]ping[ARGS] {}', ("Sure. ", [("ping", {})])),
    ("[TOOL_CALLS]not a name[ARGS]{}", ("[TOOL_CALLS]not a name[ARGS]{}", [])),
])
def test_mistral_reads_calls_whole_and_in_random_chunks(text, expected):
    assert _read(MistralToolParser, text) == expected


# -- pythonic -----------------------------------------------------------------------
PYTHONIC_TEMPLATE = "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"


def test_pythonic_conforms_and_is_chosen_by_its_template():
    check_tool_parser(PythonicToolParser)
    registry = create_plugin_manager().registries.tool_parsers
    assert registry.owner("pythonic") == "tool_parser_pythonic"
    assert select_tool_parser(registry, PYTHONIC_TEMPLATE) is PythonicToolParser
    assert select_tool_parser(registry, "<|header_start|>{{ role }}<|header_end|>") is PythonicToolParser


@pytest.mark.parametrize(("text", "expected"), [
    ('[get_weather(city="Paris", unit="c"), other(x=1)]',
     (None, [("get_weather", {"city": "Paris", "unit": "c"}), ("other", {"x": 1})])),
    (' \n[f(a=[1, -2.5, None], b={"k": True, "s": \'x]y\'}, c=False), noop()]\nDone.',
     ("\nDone.", [("f", {"a": [1, -2.5, None], "b": {"k": True, "s": "x]y"}, "c": False}), ("noop", {})])),
    ('[f(x="a, b)")]', (None, [("f", {"x": "a, b)"})])),
    ("[f(x=y)]", ("[f(x=y)]", [])),  # a name is not a literal
    ("[f(1)]", ("[f(1)]", [])),  # positional arguments
    ('[os.system(cmd="ls")]', ('[os.system(cmd="ls")]', [])),  # not a plain name
    ("[f(x=1 + 2)]", ("[f(x=1 + 2)]", [])),
    ("[f(x={1, 2})]", ("[f(x={1, 2})]", [])),  # a set
    ("[f(x=1e999)]", ("[f(x=1e999)]", [])),  # not finite
    ("[f(x=1, x=2)]", ("[f(x=1, x=2)]", [])),
    ("[1, 2] is a list", ("[1, 2] is a list", [])),
    ("[]", ("[]", [])),
    ("[f(x=1)", ("[f(x=1)", [])),  # never closed
    ("Call [f(x=1)] later", ("Call [f(x=1)] later", [])),  # calls open the answer
])
def test_pythonic_reads_calls_whole_and_in_random_chunks(text, expected):
    assert _read(PythonicToolParser, text) == expected


# -- granite ------------------------------------------------------------------------
GRANITE_TEMPLATE = "<|start_of_role|>assistant<|end_of_role|>{% if tool_calls %}<|tool_call|>{{ calls }}{% endif %}"


def test_granite_conforms_and_is_chosen_by_its_template():
    check_tool_parser(GraniteToolParser)
    registry = create_plugin_manager().registries.tool_parsers
    assert registry.owner("granite") == "tool_parser_granite"
    assert select_tool_parser(registry, GRANITE_TEMPLATE) is GraniteToolParser


@pytest.mark.parametrize(("text", "expected"), [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "other", "arguments": {"x": {"nested": [1, "]"]}}}]',
     (None, [("get_weather", {"city": "Paris"}), ("other", {"x": {"nested": [1, "]"]}})])),
    ('Sure. <|tool_call|>[{"name": "ping", "arguments": {}}]', ("Sure. ", [("ping", {})])),
    ("<|tool_call|>oops", ("<|tool_call|>oops", [])),
    ('<|tool_call|>[{"nam": "f"}]', ('<|tool_call|>[{"nam": "f"}]', [])),
    ("<|tool_cal| no", ("<|tool_cal| no", [])),
])
def test_granite_reads_calls_whole_and_in_random_chunks(text, expected):
    assert _read(GraniteToolParser, text) == expected


# -- qwen3_coder --------------------------------------------------------------------
QWEN3_CODER_TEMPLATE = (
    "<|im_start|>system\n<tools>{{ tools }}</tools><tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
)
WEATHER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def test_qwen3_coder_conforms_and_is_chosen_by_its_template():
    check_tool_parser(Qwen3CoderToolParser)
    registry = create_plugin_manager().registries.tool_parsers
    assert registry.owner("qwen3_coder") == "tool_parser_qwen3_coder"
    assert select_tool_parser(registry, QWEN3_CODER_TEMPLATE) is Qwen3CoderToolParser
    assert select_tool_parser(registry, "<|im_start|>...<tool_call>").name == "hermes"


@pytest.mark.parametrize(("text", "expected"), [
    (WEATHER + "\n<tool_call>\n<function=other>\n<parameter=x>\n1\n</parameter>\n"
     '<parameter=opts>\n{"deep": [true, null]}\n</parameter>\n<parameter=note>\ntwo\nlines\n</parameter>\n'
     "</function>\n</tool_call>",
     (None, [("get_weather", {"city": "Paris"}), ("other", {"x": 1, "opts": {"deep": [True, None]},
                                                           "note": "two\nlines"})])),
    ("Let me look. " + WEATHER + " Done.", ("Let me look.  Done.", [("get_weather", {"city": "Paris"})])),
    ("<tool_call><function=ping></function></tool_call>", (None, [("ping", {})])),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",  # the answer ended
     (None, [("f", {"a": 1})])),
    ("<tool_call>not xml</tool_call> after", ("<tool_call>not xml</tool_call> after", [])),
    ("<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>",
     ("<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>", [])),
    ("<tool_call><function=f><parameter=a>1</function>", ("<tool_call><function=f><parameter=a>1</function>", [])),
    ("<tool_ca", ("<tool_ca", [])),
])
def test_qwen3_coder_reads_calls_whole_and_in_random_chunks(text, expected):
    assert _read(Qwen3CoderToolParser, text) == expected


# -- --tool-call-parser ----------------------------------------------------------------
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ANSWERS = {  # each parser's syntax, written by the grammar so the tiny random model "calls" get_weather
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "pythonic": '[get_weather(city="Paris")]',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}


def test_tool_call_parser_flag_names_the_parser_of_auto_answers(tiny_llama_dir, tmp_path):
    """With --tool-call-parser the named parser reads `auto` answers (here written by a
    grammar in that parser's syntax) into `tool_calls`, whatever the chat template (the
    tiny model's ChatML one would choose hermes), and the tools are described to the model
    in that parser's words."""
    from server_utils import running_server
    from tiny_models import with_context

    model_dir = with_context(tiny_llama_dir, tmp_path / "model", 2048)
    prompt_tokens = {}
    for name, answer in ANSWERS.items():
        with running_server(model_dir, engine={"num_kv_blocks": 512}, tool_call_parser=name) as server:
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": WEATHER,
                "tool_choice": "auto", "max_tokens": 200, "guided_choice": [answer]})
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls", (name, choice)
            [call] = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
            assert not choice["message"]["content"]
            prompt_tokens[name] = reply.json()["usage"]["prompt_tokens"]
    assert len(set(prompt_tokens.values())) == len(ANSWERS), prompt_tokens  # each parser's own tool prompt


def test_auto_without_a_parser_for_the_template_says_how_to_name_one():
    from ember.engine.tool_calls import setup_tools
    from ember.testing.tiny_models import CHAT_TEMPLATE

    registry = create_plugin_manager().registries.tool_parsers
    with pytest.raises(ValueError, match="--tool-call-parser NAME"):
        setup_tools(WEATHER, "auto", None, registry, CHAT_TEMPLATE)
    assert setup_tools(WEATHER, "auto", None, registry, CHAT_TEMPLATE, "pythonic").parser is PythonicToolParser
    with pytest.raises(ValueError, match="'nope' is not registered; registered: granite, hermes"):
        setup_tools(WEATHER, "auto", None, registry, CHAT_TEMPLATE, "nope")


def test_tool_call_parser_flag_refuses_an_unknown_name(tiny_llama_dir, monkeypatch, capsys):
    from ember.api.cli import main

    assert main(["serve", "--model-id", "/nonexistent", "--tool-call-parser", "nope"]) == 2
    assert "--tool-call-parser 'nope' is not a registered tool-call parser; registered: granite, hermes" in (
        capsys.readouterr().err)
    monkeypatch.setenv("EMBER_TOOL_CALL_PARSER", "also_nope")
    assert main(["serve", "--model-id", "/nonexistent"]) == 2
    assert "'also_nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a registered tool-call parser"):
        from server_utils import running_server

        with running_server(tiny_llama_dir, tool_call_parser="nope"):
            pass
