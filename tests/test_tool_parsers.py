"""Tool-call parsers and tools offline: the built-in parsers pass the conformance check
(and a parser that reports a marker's first characters as content fails it), the
parser is chosen by the chat template, tool choices are checked by name, and
``LLM.chat`` with tools returns parsed calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tiny_models import with_context

from ember.constraint import ConstraintKind
from ember.engine.llm import LLM
from ember.engine.tool_calls import chat_messages, select_tool_parser, setup_tools
from ember.plugin import create_plugin_manager
from ember.plugin.tool_parser import ForcedToolCallParser, ParserDelta, ToolCall
from ember.plugins.tool_parsers.hermes import HermesToolParser
from ember.plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from ember.sampling_params import SamplingParams
from ember.testing import check_tool_parser

ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
QWEN_LIKE = "{% if tools %}<tools>{{ tools }}</tools>{% endif %}<|im_start|>...<tool_call>"
LLAMA3_LIKE = "<|start_header_id|>{{ m['role'] }}<|end_header_id|>"


@pytest.mark.parametrize("parser", [HermesToolParser, Llama3JsonToolParser, ForcedToolCallParser])
def test_built_in_parsers_conform(parser):
    check_tool_parser(parser)


def test_the_check_catches_a_parser_that_loses_text_before_a_call():
    class Forgetful(HermesToolParser):
        name = "forgetful"

        def feed(self, text: str) -> ParserDelta:
            delta = super().feed(text)
            return ParserDelta("", delta.tool_calls) if delta.tool_calls else delta

    with pytest.raises(AssertionError, match="forgetful"):
        check_tool_parser(Forgetful)


def test_registry_and_template_choice():
    registry = create_plugin_manager().registries.tool_parsers
    assert {"hermes", "llama3_json"} <= set(registry.names())
    assert registry.owner("hermes") == "tool_parser_hermes"
    assert select_tool_parser(registry, QWEN_LIKE) is HermesToolParser
    assert select_tool_parser(registry, LLAMA3_LIKE) is Llama3JsonToolParser
    assert select_tool_parser(registry, "{{ messages }}") is None


@pytest.mark.parametrize(("choice", "words"), [
    ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not in `tools` (get_time, ping)"),
    ("sometimes", 'tool_choice must be "none", "auto"'),
])
def test_bad_tool_choices_are_named(choice, words):
    registry = create_plugin_manager().registries.tool_parsers
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        setup_tools(TOOLS, choice, None, registry, QWEN_LIKE)
    with pytest.raises(ValueError, match="tools\\[1\\].function.name 'get_time' is used by an earlier tool"):
        setup_tools([TOOLS[0], TOOLS[0]], "auto", None, registry, QWEN_LIKE)
    with pytest.raises(ValueError, match='tool_choice "auto" needs a tool-call parser'):
        setup_tools(TOOLS, "auto", None, registry, "{{ messages }}")


def test_forced_choices_build_call_schemas():
    registry = create_plugin_manager().registries.tool_parsers
    named = setup_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}, None, registry, QWEN_LIKE)
    assert named.forced.kind is ConstraintKind.JSON_SCHEMA and named.forced.schema["properties"]["name"] == {"const": "ping"}
    required = setup_tools(TOOLS, "required", None, registry, QWEN_LIKE)
    assert required.forced.schema["type"] == "array" and len(required.forced.schema["items"]["anyOf"]) == 2
    single = setup_tools(TOOLS, "required", False, registry, QWEN_LIKE)
    assert "anyOf" in single.forced.schema and single.max_calls == 1
    assert setup_tools(TOOLS, "none", None, registry, QWEN_LIKE).parser is None


def test_messages_for_templates_with_and_without_tools():
    registry = create_plugin_manager().registries.tool_parsers
    setup = setup_tools(TOOLS, "auto", None, registry, QWEN_LIKE)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
    rendered, tools = chat_messages(messages, setup, registry, QWEN_LIKE)
    assert tools == TOOLS and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    plain_template = "<|im_start|>{{ m['content'] }}"
    rendered, tools = chat_messages(messages, setup, registry, plain_template)
    assert tools is None and rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def long_llama(tiny_llama_dir, tmp_path_factory):
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-long") / "model", 2048)
    return path


def test_llm_chat_with_tools(long_llama):
    llm = LLM(model=str(long_llama), dtype="float32", num_kv_blocks=512)
    messages = [{"role": "user", "content": "what time is it?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=2, n=2)
    out = llm.chat(messages, params, tools=TOOLS, tool_choice=named)[0]
    for completion in out.outputs:
        (call,) = completion.tool_calls
        assert isinstance(call, ToolCall) and call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), ZONE)
    auto = llm.chat(messages, SamplingParams(max_tokens=5), tools=TOOLS)[0].outputs[0]
    assert auto.tool_calls == ()  # the random model's noise holds no call
    assert llm.chat(messages, SamplingParams(max_tokens=5))[0].outputs[0].tool_calls is None
    with pytest.raises(ValueError, match="'nope'"):
        llm.chat(messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
