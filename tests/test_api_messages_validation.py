"""Malformed chat messages on /v1/chat/completions: each is a 4xx whose JSON body names
the field (OpenAI's `error` object), never a 500, and the server serves afterwards
(issue 33, "Bad input": `tool_calls: [{}]` was a 500 `KeyError('name')`)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import running_server  # noqa: E402

CHAT = {"model": "m", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def http(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=128) as server:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c


def call(**function):
    return {"id": "call_1", "type": "function", "function": function}


def after(assistant: dict) -> list[dict]:
    return [{"role": "user", "content": "hi"}, assistant, {"role": "user", "content": "and?"}]


def assistant(calls, content="x"):
    return {"role": "assistant", "content": content, "tool_calls": calls}


BAD_MESSAGES = [
    ("the issue's entry: no function", [{"role": "assistant", "content": "x", "tool_calls": [{}]}], 400,
     "messages[0].tool_calls[0].function"),
    ("function without a name", after(assistant([{"function": {"arguments": "{}"}}])), 400,
     "messages[1].tool_calls[0].function.name"),
    ("name not a string", after(assistant([call(name=5, arguments="{}")])), 400,
     "messages[1].tool_calls[0].function.name"),
    ("empty name", after(assistant([call(name="", arguments="{}")])), 400,
     "messages[1].tool_calls[0].function.name"),
    ("function not an object", after(assistant([{"type": "function", "function": "f"}])), 400,
     "messages[1].tool_calls[0].function"),
    ("arguments a number", after(assistant([call(name="f", arguments=5)])), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("arguments not JSON", after(assistant([call(name="f", arguments="{oops")])), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("arguments a JSON list", after(assistant([call(name="f", arguments="[1, 2]")])), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("second call bad", after(assistant([call(name="f", arguments="{}"), {"function": {}}])), 400,
     "messages[1].tool_calls[1].function.name"),
    ("type not function", after(assistant([{"type": "code", "function": {"name": "f"}}])), 400,
     "messages[1].tool_calls[0].type"),
    ("id not a string", after(assistant([{"id": 7, "function": {"name": "f"}}])), 400,
     "messages[1].tool_calls[0].id"),
    ("tool_calls on a user message", [{"role": "user", "content": "x", "tool_calls": [call(name="f")]}], 400,
     "messages[0].tool_calls"),
    ("tool_calls entry not an object", after(assistant(["f"])), 422, "messages.1.tool_calls.0"),
    ("tool_calls not a list", after(assistant({"name": "f"})), 422, "messages.1.tool_calls"),
    ("content part of unknown type", [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], 422,
     "messages[0].content[0].type"),
    ("text part without text", [{"role": "user", "content": [{"type": "text"}]}], 422,
     "messages[0].content[0].text"),
    ("text part text a number", [{"role": "user", "content": [{"type": "text", "text": 1}]}], 422,
     "messages.0.content"),
    ("content a number", [{"role": "user", "content": 3}], 422, "messages.0.content"),
    ("null content without calls", [{"role": "user", "content": None}], 422, "messages[0].content"),
    ("unknown role", [{"role": "robot", "content": "x"}], 422, "messages.0.role"),
    ("tool_call_id a number", [{"role": "tool", "content": "x", "tool_call_id": 1}], 422,
     "messages.0.tool_call_id"),
    ("message not an object", ["hello"], 422, "messages.0"),
    ("no messages", [], 422, "messages"),
]


@pytest.mark.parametrize("messages,status,param", [c[1:] for c in BAD_MESSAGES], ids=[c[0] for c in BAD_MESSAGES])
def test_malformed_message_is_a_4xx_naming_the_field(http, messages, status, param):
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.rsplit(".", 1)[0] in error["message"], error
    ok = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("arguments", ['{"c": 1}', {"c": 1}, "", None])
def test_well_formed_tool_call_turns_are_served(http, arguments):
    function = {"name": "f"} if arguments is None else {"name": "f", "arguments": arguments}
    messages = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": function}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        {"role": "tool", "content": "no id"},  # the template does not need one
    ]
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["name", "arguments", "function", "type", "id", "text", "role", "content"]), inner, max_size=3),
    max_leaves=8,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": _json, "tool_calls": _json, "tool_call_id": _json, "name": _json},
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(_message | _json, min_size=0, max_size=3))
def test_no_message_shape_is_a_5xx(http, messages):
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "messages": messages})
    assert r.status_code < 500, (messages, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]
