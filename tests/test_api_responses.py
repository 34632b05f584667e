"""/v1/responses (OpenAI's Responses API), end to end: a real uvicorn server with an API key
on the tiny random Llama, the official `openai` SDK (create, stream, retrieve, parse, delete),
raw httpx for the error bodies and the SSE event sequence."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pydantic
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
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather in a city", "parameters": WEATHER,
          "strict": True}]
BASE = {"model": "tiny", "input": "hello", "max_output_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-responses") / "model", MAX_TOTAL_TOKENS)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, engine={"num_kv_blocks": 1024}, max_total_tokens=MAX_TOTAL_TOKENS,
                        served_model_name="tiny", api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"authorization": f"Bearer {KEY}"}) as c:
        yield c


def create(client, **kwargs):
    return client.responses.create(**{**BASE, **kwargs})


def prompt_ids(server, messages):
    service = server.app.state.service
    return service.encode(service.client.apply_chat_template(messages, None), add_special_tokens=False)


def chat_text(http, messages, max_tokens=5):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def events_of(http, body):
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # every event's name is its data's type
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    return data


def test_plain_text_is_the_chat_answer(client, server, http):
    r = create(client)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text == r.output_text
    assert r.output_text == chat_text(http, [{"role": "user", "content": "hello"}])
    # the tiny model never draws EOS: cut by max_output_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    usage = r.usage
    assert usage.input_tokens == len(prompt_ids(server, [{"role": "user", "content": "hello"}]))
    assert usage.output_tokens == 5 and usage.total_tokens == usage.input_tokens + 5
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert r.store is True and r.tools == [] and r.text.format.type == "text" and r.truncation == "disabled"


def test_item_list_input_and_instructions(client, server, http):
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hel"},
                                                             {"type": "input_text", "text": "lo"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
             {"role": "user", "content": "again"}]
    r = create(client, input=items, instructions="you are tiny")
    messages = [{"role": "system", "content": "you are tiny"}, {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hel\nlo"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "again"}]
    assert r.usage.input_tokens == len(prompt_ids(server, messages))
    assert r.output_text == chat_text(http, messages)
    assert r.instructions == "you are tiny"


def test_streamed_events_join_to_the_answer(client, http):
    whole = create(client, max_output_tokens=12)
    data = events_of(http, {**BASE, "max_output_tokens": 12})
    names = [d["type"] for d in data]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert names[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert data[0]["response"]["status"] == "in_progress" and data[0]["response"]["output"] == []
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert text == whole.output_text
    assert next(d for d in data if d["type"] == "response.output_text.done")["text"] == text
    final = data[-1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 12 and final["usage"]["input_tokens"] == whole.usage.input_tokens
    # the SDK reads the same stream (create(stream=True))
    sdk = list(create(client, max_output_tokens=12, stream=True))
    assert [e.type for e in sdk] == names
    assert sdk[-1].response.output_text == text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    kwargs = dict(max_output_tokens=200, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        with client.responses.stream(**{**BASE, **kwargs}) as s:
            events = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in events and events[-1] == "response.completed"
    else:
        r = create(client, **kwargs)
    assert r.status == "completed"
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    turn = [{"role": "user", "content": "hello"}, call,  # sent back as the SDK returned it
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}]
    answer = create(client, input=turn, tools=TOOLS, tool_choice="none", max_output_tokens=4)
    assert answer.output[0].type == "message" and answer.output_text
    plain = create(client, tools=TOOLS, tool_choice="none", max_output_tokens=1)
    assert answer.usage.input_tokens > plain.usage.input_tokens + 10  # the call and its output are in the prompt


def test_required_tool_choice_and_parallel_calls(client):
    r = create(client, max_output_tokens=300, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and r.parallel_tool_calls is False


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    unit: str


def test_text_format_json_schema_and_parse(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = create(client, max_output_tokens=200, text={"format": fmt})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    parsed = client.responses.parse(**{**BASE, "max_output_tokens": 200}, text_format=Weather)
    assert isinstance(parsed.output_parsed, Weather)
    obj = create(client, max_output_tokens=200, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_continues_and_retrieve(client, http, server):
    first = create(client)
    second = create(client, input="and then?", previous_response_id=first.id)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then?"}]
    assert second.usage.input_tokens == len(prompt_ids(server, messages))
    assert second.output_text == chat_text(http, messages)
    assert second.previous_response_id == first.id
    third = create(client, input="more", previous_response_id=second.id)  # the chain holds all three turns
    assert third.usage.input_tokens > second.usage.input_tokens + first.usage.output_tokens
    for query in ("stream=true", "include=reasoning.encrypted_content"):
        r = http.get(f"/v1/responses/{second.id}?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == query.split("=")[0], r.text
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text and got.usage == second.usage
    deleted = http.delete(f"/v1/responses/{first.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert first.id in str(info.value)


def test_input_items_list_the_conversation(client, http):
    first = create(client, input=[{"role": "user", "content": "hello"}])
    second = create(client, input="and then?", previous_response_id=first.id)
    page = client.responses.input_items.list(second.id)
    assert [item.type for item in page.data] == ["message"] * 3 and page.has_more is False
    assert [item.role for item in page.data] == ["user", "assistant", "user"]  # newest first
    assert page.data[0].content[0].text == "and then?" and page.data[0].content[0].type == "input_text"
    assert page.data[1].id == first.output[0].id and page.data[1].content[0].text == first.output_text
    assert page.data[2].id == client.responses.input_items.list(first.id).data[0].id  # ids are kept
    asc = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [item["id"] for item in asc["data"]] == [page.data[2].id, page.data[1].id] and asc["has_more"] is True
    rest = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc", "after": asc["last_id"]}).json()
    assert [item["id"] for item in rest["data"]] == [page.data[0].id] and rest["has_more"] is False
    for params, param in [({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "x"}, "after"),
                          ({"include": "x"}, "include")]:
        r = http.get(f"/v1/responses/{second.id}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.get("/v1/responses/resp_nope/input_items").status_code == 404


def test_stored_streamed_response(client, http):
    data = events_of(http, BASE)
    got = client.responses.retrieve(data[-1]["response"]["id"])
    assert got.output_text == "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")


def test_unknown_ids_store_false_and_cancel(client, http):
    for path in ("/v1/responses/resp_nope",):
        r = http.get(path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "resp_nope" in r.text
    r = http.post("/v1/responses", json={**BASE, "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id" and "resp_nope" in r.text
    unstored = create(client, store=False)
    assert unstored.store is False
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    assert http.delete(f"/v1/responses/{unstored.id}").status_code == 404
    stored = create(client)
    r = http.post(f"/v1/responses/{stored.id}/cancel")
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    assert http.post("/v1/responses/resp_nope/cancel").status_code == 404


def test_store_bounds_size_and_age(model_dir):
    with running_server(model_dir, engine={"num_kv_blocks": 1024}, max_total_tokens=MAX_TOTAL_TOKENS,
                        served_model_name="tiny", responses_store_size=2, responses_store_ttl=1.5,
                        max_concurrent_requests=1) as running, \
            httpx.Client(base_url=running.url, timeout=60) as raw:
        with raw.stream("POST", "/v1/responses", json={**BASE, "stream": True}) as held:  # holds the one slot
            busy = raw.post("/v1/responses", json=BASE)
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_exceeded", busy.text
            held.read()
        ids = [raw.post("/v1/responses", json=BASE).json()["id"] for _ in range(3)]
        assert [raw.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]  # the oldest left
        time.sleep(1.6)
        r = raw.post("/v1/responses", json={**BASE, "previous_response_id": ids[2]})
        assert r.status_code == 404 and ids[2] in r.json()["error"]["message"]  # expired
    with running_server(model_dir, engine={"num_kv_blocks": 1024}, max_total_tokens=MAX_TOTAL_TOKENS,
                        responses_store_size=0) as running, \
            httpx.Client(base_url=running.url, timeout=60) as raw:
        first = raw.post("/v1/responses", json=BASE).json()
        assert first["store"] is True and raw.get(f"/v1/responses/{first['id']}").status_code == 404


def test_store_flags_and_variables():
    from ember.api.cli import build_parser
    from ember.api.cli_env import apply_defaults
    from ember.api.settings import ServerSettings

    def serve_args(argv, environ):
        args = build_parser().parse_args(["serve", *argv])
        apply_defaults(args, environ)
        return args

    defaults = serve_args([], {})
    assert (defaults.responses_store_size, defaults.responses_store_ttl) == (256, 3600.0)
    args = serve_args(["--responses-store-ttl", "5"], {"EMBER_RESPONSES_STORE_SIZE": "0",
                                                        "EMBER_RESPONSES_STORE_TTL": "9"})
    assert (args.responses_store_size, args.responses_store_ttl) == (0, 5.0)  # the flag wins over the variable
    for bad in ({"responses_store_size": -1}, {"responses_store_ttl": 0}, {"responses_store_ttl": float("inf")}):
        with pytest.raises(ValueError, match="--responses-store-"):
            ServerSettings(**bad)


def test_store_unit_bounds():
    from ember.api.responses_store import ResponsesStore

    now = [0.0]
    store = ResponsesStore(2, 10.0, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [], "m", 0)
        now[0] += 4
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    now[0] = 14.5  # r1 was stored at 4: 10.5 s old
    assert store.get("r1") is None and store.get("r2") is not None
    with pytest.raises(ValueError):
        ResponsesStore(-1, 1.0)


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "image_generation"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"nonsense": 1}, "nonsense"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),  # the text-only model takes no images
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [5]}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"temperature": 3}, "temperature"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"metadata": {"k": 1}}, "metadata.k"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(http, server, change, param):
    r = http.post("/v1/responses", json={**BASE, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    wait_idle(server.app)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("change", "param"), [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(x"}}}},
     "text.format"),
    ({"guided_regex": "(x"}, "guided_regex"),
])
def test_a_grammar_that_fails_is_a_400_before_the_stream(http, change, param, stream):
    r = http.post("/v1/responses", json={**BASE, **change, "stream": stream})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["code"] == "grammar" and r.json()["error"]["param"] == param


def test_a_failing_step_is_an_error_event_then_response_failed(http, server):
    runner = server.app.state.service.client.engine.runner  # a fault planted inside the engine
    real_execute, calls = runner.execute, {"n": 0}

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-stream: after the prefill and one decode step
            raise RuntimeError("simulated device failure")
        return real_execute(scheduler_output)

    runner.execute = flaky
    try:
        data = events_of(http, {**BASE, "max_output_tokens": 20})
    finally:
        runner.execute = real_execute
    assert [d["type"] for d in data][-2:] == ["error", "response.failed"]
    assert "simulated device failure" in data[-2]["message"] and data[-2]["code"] == "generation"
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and "simulated device failure" in failed["error"]["message"]
    assert http.get(f"/v1/responses/{failed['id']}").status_code == 404  # a failed response is not stored
    assert http.post("/v1/responses", json=BASE).status_code == 200
    wait_idle(server.app)


def test_limits_name_responses_fields(http):
    r = http.post("/v1/responses", json={**BASE, "max_output_tokens": 5000})
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_output_tokens", r.text
    r = http.post("/v1/responses", json={**BASE, "input": "x" * 100_000})
    assert r.status_code == 422 and r.json()["error"]["param"] == "input", r.text
    with httpx.Client(base_url=http.base_url, timeout=30) as raw:
        assert raw.post("/v1/responses", json=BASE).status_code == 401


def test_schemathesis_never_gets_a_5xx(server, http):
    """Bodies drawn from the server's own /openapi.json schema of /v1/responses: never a 5xx."""
    import schemathesis  # in the test extras: a missing install fails, not skips
    from hypothesis import HealthCheck, given, settings

    operation = schemathesis.openapi.from_dict(http.get("/openapi.json").json())["/v1/responses"]["POST"]

    @given(case=operation.as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def call(case):
        if isinstance(case.body, dict):  # short answers: the point is the validation
            case.body = {**case.body, "max_output_tokens": 2}
        response = case.call(base_url=server.url, timeout=60, headers={"authorization": f"Bearer {KEY}"})
        assert response.status_code < 500, (case.body, response.text)

    call()
    wait_idle(server.app)


def test_openapi_documents_the_routes(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert "post" in paths["/v1/responses"] and "get" in paths["/v1/responses/{response_id}"]
    assert "delete" in paths["/v1/responses/{response_id}"]


def test_unknown_model_is_a_404_with_adapters_on(tiny_llama_dir):
    with running_server(tiny_llama_dir, engine={"enable_lora": True}, max_total_tokens=64,
                        served_model_name="tiny") as running, httpx.Client(base_url=running.url, timeout=60) as raw:
        r = raw.post("/v1/responses", json={**BASE, "model": "nope", "max_output_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "nope" in r.text
        assert raw.post("/v1/responses", json={**BASE, "max_output_tokens": 2}).status_code == 200


def test_reasoning_items_with_a_reasoning_parser(tiny_llama_dir):
    """With --reasoning-parser, the reasoning is a `reasoning` item before the message, streamed as
    reasoning_text events. deepseek_r1 reads an answer as reasoning until `</think>`, which the random
    model never writes: the whole (cut) answer is reasoning, as the chat route's `reasoning_content`."""
    body = {**BASE, "max_output_tokens": 6}
    with running_server(tiny_llama_dir, max_total_tokens=128, reasoning_parser="deepseek_r1") as running, \
            httpx.Client(base_url=running.url, timeout=60) as raw:
        chat = raw.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 6, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "hello"}]}).json()
        thought = chat["choices"][0]["message"]["reasoning_content"]
        assert thought and not chat["choices"][0]["message"]["content"]
        r = raw.post("/v1/responses", json=body).json()
        reasoning, message = r["output"]
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == [] and reasoning["id"].startswith("rs_")
        assert reasoning["content"] == [{"type": "reasoning_text", "text": thought}]
        assert message["type"] == "message" and message["content"][0]["text"] == ""
        assert r["status"] == "incomplete" and r["usage"]["output_tokens"] == 6
        assert 0 < r["usage"]["output_tokens_details"]["reasoning_tokens"] <= 6
        data = events_of(raw, body)
        names = [d["type"] for d in data]
        assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert names.index("response.reasoning_text.done") < names.index("response.content_part.done") \
            < names.index("response.output_item.done")
        assert "".join(d["delta"] for d in data if d["type"] == "response.reasoning_text.delta") == thought
        final = data[-1]["response"]
        assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
        assert final["output"][0]["content"][0]["text"] == thought
        # the reasoning item sent back is accepted and left out of the prompt, as in a continuation
        turn = [{"role": "user", "content": "hello"}, reasoning, message, {"role": "user", "content": "again"}]
        again = raw.post("/v1/responses", json={**BASE, "input": turn})
        assert again.status_code == 200, again.text
        chained = raw.post("/v1/responses", json={**BASE, "input": "again", "previous_response_id": r["id"]})
        assert chained.json()["usage"]["input_tokens"] == again.json()["usage"]["input_tokens"]


def test_the_event_writer_opens_and_closes_items_in_order():
    """Reasoning, then text, then a call (what the parsers report of one answer): each item is
    closed before the next opens, sequence numbers count up, the items are the response's output."""
    from ember.api.routes.responses_events import EventWriter

    writer = EventWriter()
    raw = [*writer.start({"id": "resp_1", "status": "in_progress"}), *writer.reasoning("thin"), *writer.reasoning("k"),
           *writer.text("An"), *writer.text("swer"), *writer.call("call_1", "f"), *writer.arguments('{"a":'),
           *writer.arguments(" 1}"), *writer.close("completed")]
    events = [json.loads(chunk.decode().split("data: ", 1)[1]) for chunk in raw]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    reasoning, message, call = writer.output
    assert reasoning["content"][0]["text"] == "think" and message["content"][0]["text"] == "Answer"
    assert call["arguments"] == '{"a": 1}' and call["call_id"] == "call_1" and call["status"] == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert raw[0].startswith(b"event: response.created\ndata: ")


def test_the_model_field_selects_a_lora_adapter(tiny_llama_dir, tmp_path):
    """`model` names a LoRA adapter as on the chat route: the same greedy answer as chat's with that model."""
    import peft
    import torch
    import transformers

    from ember.api.lora import LoRAModule

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    adapter = peft.get_peft_model(base, config)
    with torch.no_grad():
        for module in adapter.modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                module.lora_B["default"].weight.mul_(4.0)
    adapter.save_pretrained(tmp_path / "sql")
    engine = {"enable_lora": True, "lora_modules": {"sql": str(tmp_path / "sql")}, "max_loras": 1, "max_lora_rank": 8}
    with running_server(tiny_llama_dir, engine=engine, max_total_tokens=128, served_model_name="tiny",
                        lora_modules=[LoRAModule("sql", str(tmp_path / "sql"))]) as running, \
            httpx.Client(base_url=running.url, timeout=60) as raw:
        texts = {}
        for model in ("tiny", "sql"):
            r = raw.post("/v1/responses", json={**BASE, "model": model, "max_output_tokens": 8})
            assert r.status_code == 200 and r.json()["model"] == model, r.text
            texts[model] = r.json()["output"][0]["content"][0]["text"]
            messages = [{"role": "user", "content": "hello"}]
            chat = raw.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 8,
                                                           "temperature": 0})
            assert chat.json()["choices"][0]["message"]["content"] == texts[model], model
        assert texts["tiny"] != texts["sql"]
