"""Reasoning parsers (issue 33 item 5): the contract and its conformance check, the
built-in `deepseek_r1` and `qwen3`, registration by plugin, `--reasoning-parser`, and
`reasoning_content` on /v1/chat/completions (streamed and not) from a tiny model whose
answer a regular expression forces to hold `<think>` tags."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server_utils import running_server

from ember.api.cli import main
from ember.plugin import create_plugin_manager, get_registries, hookimpl
from ember.plugin.reasoning_parser import ReasoningDelta, ThinkTagReasoningParser
from ember.plugins.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from ember.testing import check_reasoning_parser


@pytest.mark.parametrize("parser_cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_built_in_parsers_pass_the_conformance_check(parser_cls):
    for seed in range(3):
        check_reasoning_parser(parser_cls, seed=seed)
    assert get_registries().reasoning_parsers.get(parser_cls.name) is parser_cls


def test_the_two_syntaxes():
    assert Qwen3ReasoningParser().extract("<think>\nhm\n</think>\n\nYes.") == ("\nhm\n", "\n\nYes.")
    assert Qwen3ReasoningParser().extract("Yes, no thinking.") == (None, "Yes, no thinking.")
    assert Qwen3ReasoningParser().extract("<think>cut off") == ("cut off", "")
    assert DeepSeekR1ReasoningParser().extract("hm, 2 + 2</think>4") == ("hm, 2 + 2", "4")
    assert DeepSeekR1ReasoningParser().extract("<think>hm</think>4") == ("hm", "4")
    assert DeepSeekR1ReasoningParser().extract("still thinking") == ("still thinking", "")
    parser = Qwen3ReasoningParser()
    pieces = [parser.feed(p) for p in ["<th", "ink>a</th", "inkish</", "think>b"]] + [parser.finish()]
    assert pieces == [ReasoningDelta("", ""), ReasoningDelta("a", ""), ReasoningDelta("</thinkish", ""),
                      ReasoningDelta("", "b"), ReasoningDelta("", "")]


def test_a_broken_parser_is_caught_by_the_check():
    class Lossy(ThinkTagReasoningParser):
        name = "lossy"

        def feed(self, text):
            delta = super().feed(text)
            return ReasoningDelta(delta.reasoning, delta.content[:-1] if len(delta.content) > 1 else delta.content)

    with pytest.raises(AssertionError, match="lossy"):
        check_reasoning_parser(Lossy)


def test_a_plugin_registers_a_reasoning_parser():
    class Bracket(ThinkTagReasoningParser):
        name = "bracket"
        start_tag, end_tag = "[[", "]]"

    class Plugin:
        @hookimpl
        def ember_register_reasoning_parsers(self, registry):
            registry.register(Bracket.name, Bracket)

    check_reasoning_parser(Bracket)
    registry = create_plugin_manager(extra_plugins=[("bracket_plugin", Plugin())]).registries.reasoning_parsers
    assert registry.get("bracket") is Bracket and registry.owner("bracket") == "bracket_plugin"
    assert {"deepseek_r1", "qwen3", "bracket"} <= set(registry.names())


def test_an_unknown_reasoning_parser_is_refused_before_loading(capsys, monkeypatch):
    assert main(["serve", "--model-id", "/nonexistent", "--reasoning-parser", "nope"]) == 2
    assert "--reasoning-parser 'nope' is not a registered reasoning parser; registered: deepseek_r1, qwen3" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("EMBER_REASONING_PARSER", "also_nope")
    assert main(["serve", "--model-id", "/nonexistent"]) == 2
    assert "'also_nope' is not a registered reasoning parser" in capsys.readouterr().err


# -- /v1/chat/completions ---------------------------------------------------------------------
# the tiny model thinks as scripted (test_grammar_budget.Script); the grammar constrains the answer after it
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
        "guided_regex": "[a-z]{3}", "extra": {"script": "<think>abcd</think>"}}


def streamed(http: httpx.Client, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]


@pytest.fixture(scope="module")
def http(tiny_llama_dir):
    from test_grammar_budget import ScriptPlugin

    import ember.engine.core

    def with_script(*args, **kwargs):
        return create_plugin_manager(*args, extra_plugins=[("script-test", ScriptPlugin())], **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ember.engine.core, "create_plugin_manager", with_script)
        with running_server(tiny_llama_dir, max_total_tokens=128, reasoning_parser="qwen3") as server, \
                httpx.Client(base_url=server.url, timeout=60) as c:
            yield c


def test_chat_returns_reasoning_content(http):
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    reasoning, content = message["reasoning_content"], message["content"]
    assert re.fullmatch("[a-z]{4}", reasoning) and re.fullmatch("[a-z]{3}", content), message
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    deltas = streamed(http, CHAT)
    kinds = [key for d in deltas for key in ("reasoning_content", "content") if d.get(key)]
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index), deltas  # reasoning first
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert not any("<think>" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)


def test_without_think_tags_everything_is_content(http):
    plain = {**CHAT, "guided_regex": "[a-z]{5}", "extra": {"script": "a"}}  # an answer from the first token
    r = http.post("/v1/chat/completions", json=plain)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and re.fullmatch("[a-z]{5}", message["content"])
    deltas = streamed(http, plain)
    assert not any(d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_off_by_default(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=128) as server:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            forced = r"<think>[a-z]{4}</think>[a-z]{3}"  # without a parser a grammar covers the whole answer
            body = {**CHAT, "guided_regex": forced}
            del body["extra"]
            message = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert "reasoning_content" not in message and re.fullmatch(forced, message["content"])
            assert not any("reasoning_content" in d for d in streamed(c, body))
