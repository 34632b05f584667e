"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), end to end: a real
uvicorn server with an API key, the official `anthropic` SDK, raw httpx for the error bodies
and the SSE event sequence."""

from __future__ import annotations

import json

import anthropic  # the `test` extra installs it
import httpx
import jsonschema
import pytest
from server_utils import running_server, wait_idle  # noqa: E402
from tiny_models import with_context

KEY = "sekrit"
MAX_TOTAL_TOKENS = 2048  # byte tokens: a tool prompt is several hundred
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "weather in a city", "input_schema": WEATHER}]
MESSAGES = [{"role": "user", "content": "hello"}]
GREEDY = {"temperature": 0}
BASE = {"model": "tiny", "max_tokens": 5, "messages": MESSAGES}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-anthropic") / "model", MAX_TOTAL_TOKENS)
    with running_server(path, engine={"num_kv_blocks": 1024}, max_total_tokens=MAX_TOTAL_TOKENS,
                        served_model_name="tiny", api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"x-api-key": KEY}) as c:
        yield c


def create(client, **kwargs):
    """Greedy: the SDK no longer has `temperature` as an argument; it goes in the body."""
    return client.messages.create(**{"model": "tiny", "max_tokens": 8, "messages": MESSAGES, "extra_body": GREEDY,
                                     **kwargs})


def prompt_ids(server, messages, system=None):
    service = server.app.state.service
    chat = ([{"role": "system", "content": system}] if system else []) + messages
    return service.encode(service.client.apply_chat_template(chat, None), add_special_tokens=False)


def test_plain_message(client, server):
    r = create(client)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "tiny"
    [block] = r.content
    assert block.type == "text" and block.text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None  # the tiny model never draws EOS
    assert r.usage.input_tokens == len(prompt_ids(server, MESSAGES)) and r.usage.output_tokens == 8


def test_system_prompt_and_count_tokens(client, server):
    r = create(client, system="be brief")
    assert r.usage.input_tokens == len(prompt_ids(server, MESSAGES, "be brief"))
    blocks = [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]
    counted = client.messages.count_tokens(model="tiny", messages=MESSAGES, system=blocks)
    assert counted.input_tokens == len(prompt_ids(server, MESSAGES, "be\nbrief"))
    with_tools = client.messages.count_tokens(model="tiny", messages=MESSAGES, tools=TOOLS,
                                              tool_choice={"type": "any"})
    assert with_tools.input_tokens > counted.input_tokens  # the tools are in the prompt


def test_stop_sequences(client):
    full = create(client, max_tokens=24).content[0].text
    start = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i: i + 2])
    stop = full[start: start + 2]
    r = create(client, max_tokens=24, stop_sequences=[stop])
    assert r.content[0].text == full[: full.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with client.messages.stream(model="tiny", max_tokens=24, messages=MESSAGES, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == r.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_streaming_equals_the_whole_answer(client, http):
    whole = create(client, max_tokens=12)
    with client.messages.stream(model="tiny", max_tokens=12, messages=MESSAGES, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens
    with http.stream("POST", "/v1/messages", json={**BASE, "stream": True}) as r:
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client, stream):
    kwargs = dict(model="tiny", max_tokens=200, messages=MESSAGES, extra_body=GREEDY, tools=TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with client.messages.stream(**kwargs) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(**kwargs)
    assert r.stop_reason == "tool_use"
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    turn = MESSAGES + [{"role": "assistant", "content": r.content},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": [{"type": "text", "text": "sunny, 21"}]},
                                                    {"type": "text", "text": "so?"}]}]
    answer = client.messages.create(model="tiny", max_tokens=4, messages=turn, extra_body=GREEDY, tools=TOOLS)
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text" and answer.content[0].text


def test_both_key_headers_and_401(server):
    body = {**BASE, "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as raw:
        assert raw.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
        assert raw.post("/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        for headers in ({}, {"x-api-key": "wrong"}):
            r = raw.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad, \
            pytest.raises(anthropic.AuthenticationError):
        create(bad)


BAD = [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"nonsense": 1}, 400, "nonsense"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "--reasoning-parser"),  # none on this server
    ({"thinking": {"type": "disabled", "budget_tokens": 1024}}, 400, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 9}}, 400, "thinking.budget_tokens"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking"}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, 400,
     "messages[0].content[0].type"),
    ({"mcp_servers": []}, 400, "mcp_servers"),
    ({"container": "c"}, 400, "container"),
    ({"output_config": {"effort": "low"}}, 400, "output_config"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "`messages[0].content[0]`: model 'tiny' takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     400, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]}, 400,
     "input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "x"}]}]},
     400, "is_error"),
    ({"system": 5}, 400, "system"),
    ({"temperature": 3}, 400, "temperature"),
    ({"stop_sequences": [""]}, 400, "stop_sequences"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope'"),
    ({"tools": [{"name": "x", "input_schema": {}, "type": "web_search_20250305"}]}, 400, "tools.0.type"),
    ({"max_tokens": 5000}, 422, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 100_000}]}, 422, "messages"),
]


@pytest.mark.parametrize(("change", "status", "words"), BAD)
def test_bad_input_is_named_in_anthropic_shape(http, server, change, status, words):
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == "invalid_request_error"
    assert words in payload["error"]["message"], payload["error"]["message"]
    if status == 400 and "max_tokens" not in change:
        counted = http.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k in (
            "model", "messages", "system", "tools", "tool_choice", "thinking", "nonsense")})
        if any(k in change for k in ("messages", "system", "tools", "tool_choice", "thinking", "nonsense")):
            assert counted.status_code == 400 and counted.json()["type"] == "error", counted.text
    wait_idle(server.app)


def test_unknown_route_and_sdk_errors(client, http):
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, stop_sequences=[""])
    assert "stop_sequences" in str(info.value)


def test_openapi_documents_the_routes(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert "post" in paths["/v1/messages"] and "post" in paths["/v1/messages/count_tokens"]


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (404, "not_found_error"), (413, "request_too_large"),
                                              (422, "invalid_request_error"), (429, "rate_limit_error"),
                                              (500, "api_error"), (503, "overloaded_error")])
def test_error_types_by_status(status, kind):
    """Every status in Anthropic's error types (an unknown model or adapter is a 404 `not_found_error`)."""
    from ember.api.errors import APIError, Flavor, error_body

    body = error_body(APIError(status, "the model `x` does not exist", "model_not_found", "model"), Flavor.ANTHROPIC)
    assert body == {"type": "error", "error": {"type": kind, "message": "the model `x` does not exist"}}


def test_streamed_tool_use_events(http):
    body = {**BASE, "max_tokens": 200, "stream": True, "temperature": 0, "tools": TOOLS, "tool_choice": {"type": "any"}}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # every event's name is its data's type
    start = next(d for d in data if d["type"] == "content_block_start")["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for d in data if d["type"] == "content_block_delta")
    jsonschema.validate(json.loads(partial), WEATHER)
    assert data[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and names[-1] == "message_stop"


def test_unknown_model_is_a_404_with_adapters_on(tiny_llama_dir):
    """With LoRA on, `model` names the base or a loaded adapter (as on the OpenAI routes); another name is a 404."""
    with running_server(tiny_llama_dir, engine={"enable_lora": True}, max_total_tokens=64,
                        served_model_name="tiny") as running, httpx.Client(base_url=running.url, timeout=60) as raw:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {**BASE, "model": "nope"} if path == "/v1/messages" else {"model": "nope", "messages": MESSAGES}
            r = raw.post(path, json=body)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["type"] == "not_found_error" and "nope" in r.json()["error"]["message"]
            assert raw.post(path, json={**body, "model": "tiny"}).status_code == 200


# -- reasoning models: thinking blocks ------------------------------------------------------------
def test_earlier_thinking_blocks_stay_out_of_the_prompt(http):
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
             {"role": "user", "content": "and?"}]
    with_thinking = [plain[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "let me see", "signature": "abc"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "text", "text": "yo"}]}, plain[2]]
    counts = [http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": m}).json()
              for m in (plain, with_thinking)]
    assert counts[0] == counts[1] and counts[0]["input_tokens"] > 0


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir, tmp_path_factory):
    """deepseek_r1 reads an answer as reasoning until `</think>` (its template opens the
    tag in the prompt), so the tiny model's whole answer is thinking."""
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-thinking") / "model", 2048)
    with running_server(path, engine={"num_kv_blocks": 512}, max_total_tokens=2048, max_input_tokens=200,
                        served_model_name="tiny", reasoning_parser="deepseek_r1") as running:
        yield running


def test_reasoning_comes_back_as_a_thinking_block(thinking_server):
    with anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0, timeout=120) as client, \
            httpx.Client(base_url=thinking_server.url, timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 12,
                                                        "temperature": 0}).json()["choices"][0]["message"]
        assert chat["reasoning_content"] and not chat["content"]
        r = create(client, max_tokens=12)
        [block] = r.content
        assert block.type == "thinking" and block.thinking == chat["reasoning_content"] and block.signature == ""
        text = block.thinking
        start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i: i + 2])
        enabled = create(client, max_tokens=1100, thinking={"type": "enabled", "budget_tokens": 1024},
                         stop_sequences=[text[start: start + 2]])  # stops early: no 1100 tokens to wait for
        assert [(b.type, b.thinking) for b in enabled.content] == [("thinking", text[: text.find(text[start: start + 2])])]
        assert create(client, max_tokens=12, thinking={"type": "disabled"}).content == []  # thinking left out
        with client.messages.stream(model="tiny", max_tokens=12, messages=MESSAGES, extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.thinking) for b in final.content] == [("thinking", block.thinking)]
        with http.stream("POST", "/v1/messages", json={**BASE, "max_tokens": 12, "stream": True,
                                                       "temperature": 0}) as raw:
            data = [json.loads(line.removeprefix("data: ")) for line in raw.iter_lines() if line.startswith("data: ")]
        kinds = [d["type"] if d["type"] != "content_block_delta" else d["delta"]["type"] for d in data]
        assert kinds[:3] == ["message_start", "ping", "content_block_start"]
        assert data[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
        assert set(kinds[3:-4]) == {"thinking_delta"}
        assert kinds[-4:] == ["signature_delta", "content_block_stop", "message_delta", "message_stop"]
        held = create(client, max_tokens=1040, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in held.content] == ["thinking", "text"]  # the budget ended the thinking
        assert held.content[0].thinking.startswith(text) and held.content[1].text
        assert held.stop_reason == "max_tokens" and held.usage.output_tokens == 1040
        r = http.post("/v1/messages", json={**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 400 and "must be less than `max_tokens`" in r.json()["error"]["message"]
        r = http.post("/v1/messages", json={**BASE, "thinking": {"type": "enabled"}})
        assert r.status_code == 400 and "`thinking.budget_tokens` is required" in r.json()["error"]["message"]
