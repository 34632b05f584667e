"""Structured outputs and tool calling over HTTP, end to end: a real server on the tiny
random Llama (ChatML template: the Hermes parser reads it), the official `openai` SDK,
huggingface_hub's InferenceClient for TGI, raw httpx for error bodies and /metrics.

The tiny model writes noise, so what is checked is structure: every constrained answer
parses and validates, forced calls name the right function with schema-valid
arguments, streamed calls put together by the SDK equal the non-streamed ones.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field
from server_utils import running_server, wait_idle
from tiny_models import with_context

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {  # bounded everywhere: greedy noise from a random model must still end
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"enum": [20, 30, 40]},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hello"}]


MAX_TOTAL_TOKENS = 2048  # byte tokens: a tool prompt is several hundred


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with room for tool prompts (its random weights do not mind)."""
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-long") / "model", MAX_TOTAL_TOKENS)
    return path


def serving(model_dir, engine=None, **settings):
    return running_server(model_dir, engine={"num_kv_blocks": 1024, **(engine or {})},
                          max_total_tokens=MAX_TOTAL_TOKENS, **settings)


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 200, **kwargs}
    return client.chat.completions.create(model="m", messages=MESSAGES, **kwargs)


def check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- response_format and guided_* ------------------------------------------------------
def test_json_schema_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, response_format=fmt, n=2, temperature=0.8, seed=3)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_parse_helper_with_a_pydantic_model(client):
    class Point(BaseModel):  # ge/le: outlines refuses them, xgrammar takes over
        x: int = Field(ge=0, le=99)
        y: int = Field(ge=0, le=99)
        label: str = Field(max_length=8)

    r = client.beta.chat.completions.parse(model="m", messages=MESSAGES, temperature=0, max_tokens=200,
                                           response_format=Point)
    assert isinstance(r.choices[0].message.parsed, Point)


def test_json_object_and_streamed_json_schema(client):
    # any object: the random model may write one string on and on (SmolLM2's are checked whole)
    r = chat(client, response_format={"type": "json_object"}, max_tokens=20)
    assert r.choices[0].message.content.lstrip().startswith("{")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    chunks = list(chat(client, response_format=fmt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("backend", ["outlines", "xgrammar"])
def test_guided_fields_on_both_routes(client, backend):
    extra = {"guided_decoding_backend": backend}
    r = client.completions.create(model="m", prompt="x", max_tokens=50, temperature=0,
                                  extra_body={"guided_regex": r"[a-c]{2,5}-\d{3}", **extra})
    assert re.fullmatch(r"[a-c]{2,5}-\d{3}", r.choices[0].text)
    r = chat(client, extra_body={"guided_choice": ["red", "green", "blue"], **extra})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = chat(client, extra_body={"guided_json": PERSON, **extra})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = chat(client, extra_body={"structured_outputs": {"regex": r"(yes|no)!"}, **extra})
    assert r.choices[0].message.content in ("yes!", "no!")
    stream = client.completions.create(model="m", prompt="x", max_tokens=50, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}, **extra})
    assert "".join(c.choices[0].text for c in stream) in ("alpha", "beta")


def test_grammar_kind_outlines_lacks_falls_back(client):
    grammar = 'root ::= "(" [0-9] [0-9]? ")"'
    r = chat(client, extra_body={"guided_grammar": grammar})  # no backend named: xgrammar compiles it
    assert re.fullmatch(r"\(\d{1,2}\)", r.choices[0].message.content)


def test_schema_keyword_outlines_refuses_falls_back_unless_named(client, http):
    ranged = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
              "required": ["n"], "additionalProperties": False}
    r = chat(client, extra_body={"guided_json": ranged})
    assert 3 <= json.loads(r.choices[0].message.content)["n"] <= 7
    named = http.post("/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES, "guided_json": ranged, "guided_decoding_backend": "outlines"})
    assert named.status_code == 400 and "'minimum'" in named.json()["error"]["message"]


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "extra", "param", "words"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", "nonsense"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ("/v1/chat/completions", {"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "not": {}}}},
                              "guided_decoding_backend": "outlines"}, "guided_json", "'not'"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ("/v1/completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured-output"),
    ("/v1/completions", {"guided_choice": ["a"], "guided_decoding_backend": "nope"}, "guided_decoding_backend",
     "unknown grammar backend 'nope'"),
])
def test_bad_constraints_are_400_with_an_openai_error(http, server, route, extra, param, words, stream):
    body = {"model": "m", "max_tokens": 5, "stream": stream, **extra}
    body.update({"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": "x"})
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    wait_idle(server.app)
    assert server.app.state.service.num_in_flight == 0
    ok = http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200  # nothing broke


def test_compile_timeout_is_a_400(model_dir):
    with serving(model_dir, engine={"grammar_compile_timeout_s": 1e-3}) as running, \
            httpx.Client(base_url=running.url, timeout=60) as http:
        for num, stream in ((12, False), (13, True)):  # two schemas: no cached grammar
            # outlines takes far longer than a millisecond over this many bounded strings
            schema = {"type": "object",
                      "properties": {f"p{i}": {"type": "string", "maxLength": 30} for i in range(num)}}
            r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "guided_json": schema,
                                                   "stream": stream})
            assert r.status_code == 400 and "took longer than 0.001 s" in r.json()["error"]["message"]


# -- tools -----------------------------------------------------------------------------------
def test_named_tool_choice_forces_that_call(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, tools=TOOLS, tool_choice=choice)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    check_calls(calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_one_of_the_tools(client, parallel):
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, temperature=0.8, seed=1)
    calls = r.choices[0].message.tool_calls
    check_calls(calls, {"get_weather", "get_time"})
    assert not parallel and len(calls) == 1 or parallel


def test_streamed_tool_calls_equal_the_whole_answer(client):
    kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 0.8, "seed": 5}
    whole = chat(client, **kwargs).choices[0].message.tool_calls
    chunks = list(chat(client, stream=True, **kwargs))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name  # the name comes first, then arguments in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed: dict[int, list[str]] = {}
    for piece in pieces:
        entry = streamed.setdefault(piece.index, [piece.function.name, ""])
        entry[1] += piece.function.arguments or ""
    assert [tuple(v) for _, v in sorted(streamed.items())] == [(c.function.name, c.function.arguments) for c in whole]
    with client.beta.chat.completions.stream(model="m", messages=MESSAGES, max_tokens=200, **kwargs) as stream:
        final = stream.get_final_completion()  # the SDK's own reassembly
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_auto_and_a_tool_result_go_through_the_template(client):
    r = chat(client, tools=TOOLS, max_tokens=8)  # auto: the noise of the tiny model holds no call
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > chat(client, max_tokens=4).usage.prompt_tokens + 40  # tools, call, result


def test_none_hides_the_tools(client):
    with_none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=3)
    plain = chat(client, max_tokens=3)
    assert with_none.usage.prompt_tokens == plain.usage.prompt_tokens


# -- TGI -------------------------------------------------------------------------------------
def test_tgi_grammar(server):
    tgi = InferenceClient(server.url)
    text = tgi.text_generation("x", max_new_tokens=100, grammar={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(text), PERSON)
    text = tgi.text_generation("x", max_new_tokens=20, grammar={"type": "regex", "value": r"\d{3}-[ab]"})
    assert re.fullmatch(r"\d{3}-[ab]", text)
    pieces = list(tgi.text_generation("x", max_new_tokens=20, stream=True, grammar={"type": "regex", "value": "ok|no"}))
    assert "".join(pieces) in ("ok", "no")


def test_tgi_grammar_errors(http):
    r = http.post("/generate", json={"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(x"}}})
    assert r.status_code == 400 and r.json()["error_type"] == "grammar"
    r = http.post("/generate_stream", json={"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": "a"}}})
    assert r.status_code == 400 and "parameters.grammar" in r.json()["error"]


def test_tgi_chat_tools(server):
    tgi = InferenceClient(server.url)
    r = tgi.chat_completion(MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.0)
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- metrics -----------------------------------------------------------------------------------
def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_grammar_metrics(model_dir, engine_mode):
    with serving(model_dir, engine_mode=engine_mode) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "guided_regex": "a{2,4}b"})
            assert r.status_code == 200
        assert http.post("/v1/completions", json={"model": "m", "prompt": "x", "guided_regex": "("}).status_code == 400
        wait_idle(running.app)
        text = http.get("/metrics").text
    assert _metric(text, "ember_grammar_compiles_total") == 2
    assert _metric(text, "ember_grammar_cache_hits_total") == 1
    assert _metric(text, "ember_grammar_compile_errors_total") == 1
    assert _metric(text, "ember_grammar_compile_timeouts_total") == 0
    assert _metric(text, "ember_grammar_compile_seconds_total") > 0
