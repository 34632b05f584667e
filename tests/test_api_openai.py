"""The OpenAI routes, end to end: a real uvicorn server, the official `openai` SDK, raw
httpx for the SSE lines and the error bodies."""

from __future__ import annotations

import json
import time

import httpx
import openai  # the `test` extra installs it
import pytest

from server_utils import running_server  # noqa: E402

from ember.api.errors import APIError  # noqa: E402

MAX_TOTAL_TOKENS = 128
PROMPT = "hello world"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=MAX_TOTAL_TOKENS, served_model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_until_idle(service, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while service.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    return service.num_in_flight


def greedy_completion(client, prompt=PROMPT, **kwargs):
    return client.completions.create(model="any-name", prompt=prompt, temperature=0, **kwargs)


def streamed_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# -- /v1/completions -----------------------------------------------------------------------
def test_completion_shape_and_usage(client, server):
    r = greedy_completion(client, max_tokens=7)
    assert r.id.startswith("cmpl-") and len(r.id) > 10
    assert r.object == "text_completion"
    assert r.model == "any-name"  # any model name is accepted and echoed
    assert r.system_fingerprint.startswith("ember-")
    assert isinstance(r.created, int)
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    num_prompt = len(server.app.state.service.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (num_prompt, 7, num_prompt + 7)


def test_completion_default_max_tokens_is_16(client):
    assert greedy_completion(client).usage.completion_tokens == 16


def test_null_means_the_default(http):
    nulls = {"stop": None, "seed": None, "n": None, "temperature": None, "max_tokens": None, "user": None,
             "stream_options": None, "logprobs": None}
    # temperature null means 1.0: unseeded sampling may draw EOS before the length limit
    r = http.post("/v1/completions", json={**COMPLETION, **nulls, "echo": None})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["completion_tokens"] <= 16
    if body["usage"]["completion_tokens"] < 16:
        assert body["choices"][0]["finish_reason"] == "stop"
    r = http.post("/v1/chat/completions", json={**CHAT, **nulls, "max_tokens": 3, "response_format": None, "tools": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    r = http.post("/v1/completions", json={**COMPLETION, "model": None})
    assert r.status_code == 422 and r.json()["error"]["param"] == "model"


def test_completion_stream_concatenates_to_the_text(client):
    full = greedy_completion(client, max_tokens=12).choices[0].text
    text, chunks = streamed_text(greedy_completion(client, max_tokens=12, stream=True))
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and all(c.usage is None for c in chunks)


def test_completion_stream_include_usage(client):
    chunks = list(greedy_completion(client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert body and all(c.usage is None for c in body)


def test_stop_string_ends_the_text_before_it(client):
    full = greedy_completion(client, max_tokens=24).choices[0].text
    start = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    expected = full[: full.find(stop)]
    r = greedy_completion(client, max_tokens=24, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    text, chunks = streamed_text(greedy_completion(client, max_tokens=24, stop=stop, stream=True))
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_list_prompts_give_one_choice_each_in_order(client, server):
    prompts = ["hello", "abc", "hello world"]
    singles = [greedy_completion(client, prompt=p, max_tokens=6).choices[0].text for p in prompts]
    r = greedy_completion(client, prompt=prompts, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == singles
    num_prompt = sum(len(server.app.state.service.encode(p)) for p in prompts)
    assert r.usage.prompt_tokens == num_prompt and r.usage.completion_tokens == 18

    stream = greedy_completion(client, prompt=prompts, max_tokens=6, stream=True, stream_options={"include_usage": True})
    texts = ["", "", ""]
    reasons = [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
        if not chunk.choices:
            assert chunk.usage.completion_tokens == 18
    assert texts == singles and reasons == ["length"] * 3


def test_token_id_prompts(client, server):
    ids = server.app.state.service.encode(PROMPT)
    expected = greedy_completion(client, max_tokens=5).choices[0].text
    assert greedy_completion(client, prompt=ids, max_tokens=5).choices[0].text == expected
    r = greedy_completion(client, prompt=[ids, ids], max_tokens=5)
    assert [c.text for c in r.choices] == [expected, expected]


def test_echo_prepends_the_prompt(client, server):
    plain = greedy_completion(client, max_tokens=5).choices[0].text
    assert greedy_completion(client, max_tokens=5, echo=True).choices[0].text == PROMPT + plain
    text, _ = streamed_text(greedy_completion(client, max_tokens=5, echo=True, stream=True))
    assert text == PROMPT + plain
    ids = server.app.state.service.encode(PROMPT)
    assert greedy_completion(client, prompt=ids, max_tokens=5, echo=True).choices[0].text == PROMPT + plain


def test_same_seed_same_text(client):
    def sample(seed):
        return client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert sample(-5) == sample(-5)  # OpenAI seeds are signed


def test_penalties_logit_bias_and_vllm_extensions(client, server):
    service = server.app.state.service
    [x_id] = service.encode("x", add_special_tokens=False)
    # a +100 bias makes greedy decoding pick the token every time
    forced = greedy_completion(client, max_tokens=5, logit_bias={str(x_id): 100})
    assert forced.choices[0].text == "xxxxx"
    chat = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=4,
                                          logit_bias={str(x_id): 100})
    assert chat.choices[0].message.content == "xxxx"
    # ...and presence/frequency penalties push back against repeating it
    unpushed = greedy_completion(client, max_tokens=5, logit_bias={str(x_id): 8})
    pushed = greedy_completion(client, max_tokens=5, logit_bias={str(x_id): 8}, frequency_penalty=2.0,
                               presence_penalty=2.0)
    assert unpushed.choices[0].text == "xxxxx" and pushed.choices[0].text.count("x") < 5
    plain = greedy_completion(client, max_tokens=12).choices[0].text
    assert greedy_completion(client, max_tokens=12, presence_penalty=0, frequency_penalty=0).choices[0].text == plain
    # vLLM's extra sampling fields through the SDK's extra_body: top_k=1 sampling is greedy
    penalized = greedy_completion(client, max_tokens=12, extra_body={"repetition_penalty": 1.8}).choices[0].text
    assert penalized != plain
    sampled = client.completions.create(model="m", prompt=PROMPT, temperature=1.0, max_tokens=12, seed=5,
                                        extra_body={"top_k": 1, "min_p": 0.05, "repetition_penalty": 1.8})
    assert sampled.choices[0].text == penalized


def test_extra_switches_on_a_plugin_processor(client, server):
    try:
        server.app.state.service.client.logits_processor("ban_digits")
    except LookupError:
        pytest.fail("the example plugin is not installed: pip install --no-deps ./examples/ember-legacy-llama")
    digits = {str(i): 30 for i in server.app.state.service.encode("0123456789", add_special_tokens=False)}
    text = greedy_completion(client, max_tokens=8, logit_bias=digits).choices[0].text
    assert text.isdigit()
    banned = greedy_completion(client, max_tokens=8, logit_bias=digits, extra_body={"extra": {"ban_digits": True}})
    assert banned.choices[0].text and not any(c.isdigit() for c in banned.choices[0].text)


# -- /v1/chat/completions ------------------------------------------------------------------
def test_chat_completion(client, server):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_completion_tokens=9)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny"
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    service = server.app.state.service
    prompt = service.client.apply_chat_template(MESSAGES)
    assert r.usage.prompt_tokens == len(service.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 9

    again = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=9)
    assert again.choices[0].message.content == choice.message.content


def test_chat_default_max_tokens_fills_the_context(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0)
    assert r.usage.total_tokens == MAX_TOTAL_TOKENS and r.choices[0].finish_reason == "length"


def test_chat_stream(client):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_text_parts_and_developer_role(client):
    as_parts = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    a = client.chat.completions.create(model="m", messages=as_parts, temperature=0, max_tokens=6)
    b = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_stop_string(client):
    full = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    r = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=24, stop=stop)
    assert r.choices[0].message.content == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


# -- raw SSE ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 4, "stream": True}),
])
def test_sse_lines_end_with_done(http, path, body):
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads and all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


# -- errors -------------------------------------------------------------------------------------
COMPLETION = {"model": "m", "prompt": PROMPT}
CHAT = {"model": "m", "messages": MESSAGES}

ERRORS = [
    # (name, path, body, status, param)
    ("missing model", "/v1/completions", {"prompt": PROMPT}, 422, "model"),
    ("missing prompt", "/v1/completions", {"model": "m"}, 422, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "m"}, 422, "messages"),
    ("prompt wrong type", "/v1/completions", {**COMPLETION, "prompt": 5}, 422, "prompt"),
    ("mixed prompt list", "/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, 422, "prompt"),
    ("max_tokens as string", "/v1/completions", {**COMPLETION, "max_tokens": "5"}, 422, "max_tokens"),
    ("messages wrong type", "/v1/chat/completions", {"model": "m", "messages": "hi"}, 422, "messages"),
    ("content wrong type", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]}, 422,
     "messages.0.content"),
    ("unknown role", "/v1/chat/completions", {"model": "m", "messages": [{"role": "function", "content": "x"}]}, 422,
     "messages.0.role"),
    ("empty messages", "/v1/chat/completions", {"model": "m", "messages": []}, 422, "messages"),
    ("temperature 3", "/v1/completions", {**COMPLETION, "temperature": 3}, 422, "temperature"),
    ("top_p 0", "/v1/chat/completions", {**CHAT, "top_p": 0}, 422, "top_p"),
    ("max_tokens 0", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 422, "max_tokens"),
    ("max_tokens 10**12", "/v1/completions", {**COMPLETION, "max_tokens": 10**12}, 422, "max_tokens"),
    ("chat max_tokens 10**12", "/v1/chat/completions", {**CHAT, "max_tokens": 10**12}, 422, "max_tokens"),
    ("max_completion_tokens too many", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 500}, 422,
     "max_completion_tokens"),
    ("n=0", "/v1/completions", {**COMPLETION, "n": 0}, 422, "n"),
    ("chat n=17", "/v1/chat/completions", {**CHAT, "n": 17}, 422, "n"),
    ("best_of below n", "/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, 422, None),
    ("best_of streamed", "/v1/completions", {**COMPLETION, "n": 1, "best_of": 2, "stream": True}, 422, "best_of"),
    ("completion logprobs 6", "/v1/completions", {**COMPLETION, "logprobs": 6}, 422, "logprobs"),
    ("completion logprobs -1", "/v1/completions", {**COMPLETION, "logprobs": -1}, 422, "logprobs"),
    ("completion logprobs true", "/v1/completions", {**COMPLETION, "logprobs": True}, 422, "logprobs"),
    ("chat logprobs 3", "/v1/chat/completions", {**CHAT, "logprobs": 3}, 422, "logprobs"),
    ("chat top_logprobs 50", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 422, "top_logprobs"),
    ("chat top_logprobs -1", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, 422, "top_logprobs"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 422, "top_logprobs"),
    ("presence_penalty 3", "/v1/completions", {**COMPLETION, "presence_penalty": 3}, 422, "presence_penalty"),
    ("frequency_penalty -2.5", "/v1/chat/completions", {**CHAT, "frequency_penalty": -2.5}, 422, "frequency_penalty"),
    ("logit_bias non-integer key", "/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1.0}}, 422, "logit_bias"),
    ("logit_bias negative key", "/v1/completions", {**COMPLETION, "logit_bias": {"-5": 1.0}}, 422, "logit_bias"),
    ("logit_bias out of vocab", "/v1/completions", {**COMPLETION, "logit_bias": {"99999": 1.0}}, 422, "logit_bias"),
    ("logit_bias bias 101", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, 422, "logit_bias"),
    ("logit_bias bias not a number", "/v1/completions", {**COMPLETION, "logit_bias": {"5": "high"}}, 422,
     "logit_bias.5"),
    ("top_k -2", "/v1/completions", {**COMPLETION, "top_k": -2}, 422, "top_k"),
    ("min_p 1.5", "/v1/chat/completions", {**CHAT, "min_p": 1.5}, 422, "min_p"),
    ("repetition_penalty 0", "/v1/completions", {**COMPLETION, "repetition_penalty": 0}, 422, "repetition_penalty"),
    ("extra names a built-in", "/v1/completions", {**COMPLETION, "extra": {"top_k": 2}}, 422, None),
    ("extra names no processor", "/v1/chat/completions", {**CHAT, "extra": {"no_such": True}}, 422, None),
    ("suffix", "/v1/completions", {**COMPLETION, "suffix": "end"}, 422, "suffix"),
    ("json_schema without a schema", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ("tools without a function", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown field", "/v1/completions", {**COMPLETION, "foo": 1}, 422, "foo"),
    ("chat unknown field", "/v1/chat/completions", {**CHAT, "functions": []}, 422, "functions"),
    ("empty prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 422, "prompt"),
    ("empty prompt list", "/v1/completions", {**COMPLETION, "prompt": []}, 422, "prompt"),
    ("empty prompt in a list", "/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, 422, "prompt[1]"),
    ("prompt too long", "/v1/completions", {**COMPLETION, "prompt": "x" * 500}, 422, "prompt"),
    ("bad token id", "/v1/completions", {**COMPLETION, "prompt": [1, 99999]}, 422, "prompt"),
    ("negative token id", "/v1/completions", {**COMPLETION, "prompt": [[1], [-1]]}, 422, "prompt[1]"),
    ("image part to a text-only model", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]"),
    ("audio part", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     422, "messages[0].content[0].type"),
    ("too many stops", "/v1/completions", {**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, 422, "stop"),
    ("empty stop", "/v1/completions", {**COMPLETION, "stop": [""]}, 422, "stop"),
    ("stream_options without stream", "/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}},
     422, "stream_options"),
    ("both max tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, 422,
     "max_completion_tokens"),
    ("streamed request, bad input", "/v1/chat/completions", {**CHAT, "stream": True, "temperature": -1}, 422,
     "temperature"),
    ("body not an object", "/v1/completions", [1, 2], 422, None),
]


def test_error_after_the_stream_started_is_an_error_event(http, server, monkeypatch):
    service = server.app.state.service

    async def broken(prompt, prompt_ids, params, priority=0, output_kind=None):
        raise APIError(503, "the engine is not running", "unhealthy")
        yield  # an async generator, like GenerationService.generate

    monkeypatch.setattr(service, "generate", broken)
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        events = [e for e in r.read().decode().split("\n\n") if e]
    first, last = (json.loads(e.removeprefix("data: ")) for e in (events[0], events[-1]))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert last == {"error": {"message": "the engine is not running", "type": "service_unavailable", "param": None,
                              "code": "unhealthy"}}
    monkeypatch.undo()
    assert wait_until_idle(service) == 0


def test_no_slot_is_left_taken(server):
    assert wait_until_idle(server.app.state.service) == 0


@pytest.mark.parametrize("path, body, status, param", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_requests_get_openai_errors(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]


def test_not_available_names_the_issue(http):
    error = http.post("/v1/completions", json={**COMPLETION, "suffix": "end"}).json()["error"]
    assert "issue 4 (suffix)" in error["message"]


def test_transport_errors_are_openai_shaped(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "error" in r.json()
    r = http.post("/v1/nothing-here", json={})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_sdk_raises_on_422_and_server_keeps_serving(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model="m", prompt=PROMPT, n=0)
    assert info.value.body["param"] == "n"
    assert greedy_completion(client, max_tokens=3).usage.completion_tokens == 3
    assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3).usage.completion_tokens == 3


def test_openapi_documents_the_routes(http):
    spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = spec["paths"][path]["post"]
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert op["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIErrorResponse")
    assert "CompletionRequest" in spec["components"]["schemas"]


# -- admission ------------------------------------------------------------------------------------
def test_admission_counts_each_prompt_and_releases(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_total_tokens=MAX_TOTAL_TOKENS, max_concurrent_requests=2) as (url, app):
        service = app.state.service
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]})
            assert r.status_code == 422 and r.json()["error"]["param"] == "prompt"
            service.acquire()  # another client holds one of the two slots
            try:
                r = http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]})
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
                r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True})
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
                assert http.post("/v1/completions", json={**COMPLETION, "max_tokens": 2}).status_code == 200
            finally:
                service.release()
            assert wait_until_idle(service) == 0
            r = http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
            # a client that leaves mid-stream gives its slots back
            with http.stream("POST", "/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "max_tokens": 100,
                                                              "stream": True}) as held:
                next(held.iter_lines())
            assert wait_until_idle(service) == 0


def test_chat_logprobs_parse_in_the_sdk(client):
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=5, temperature=0)
    r = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    # (no join check: the tiny model's byte tokens may be partial UTF-8, shown as U+FFFD)
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode("utf-8"))
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the argmax
        values = [top.logprob for top in t.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(t.logprob)
    assert client.chat.completions.create(**kwargs).choices[0].logprobs is None
    plain = client.chat.completions.create(**kwargs, logprobs=True).choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in plain)
    stream = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, stream=True)
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])


@pytest.mark.parametrize("stop", [None, ["zzz"], ["qx", "\ufffd\ufffd"]])
def test_streamed_logprobs_cover_every_token_when_text_is_held_back(client, stop):
    """Streams carry only each step's tokens (DELTA outputs); a step whose text is held
    back (it may begin a stop string) reports its tokens' logprobs with a later chunk:
    none is lost or repeated, for each of n choices."""
    kwargs = dict(model="m", messages=MESSAGES, max_tokens=8, temperature=0.9, seed=3, stop=stop, n=2)
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=1)
    stream = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=1, stream=True,
                                            stream_options={"include_usage": True})
    tokens = {0: [], 1: []}
    text = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.logprobs:
                tokens[choice.index] += [t.logprob for t in choice.logprobs.content]
    for choice in whole.choices:
        assert text[choice.index] == choice.message.content
        assert tokens[choice.index] == pytest.approx([t.logprob for t in choice.logprobs.content])
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completion_logprobs_parse_in_the_sdk(client):
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and max(top.values()) == pytest.approx(logprob)
        assert 1 <= len(top) <= 2
    stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True)
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert greedy_completion(client, max_tokens=2).choices[0].logprobs is None


def test_n_choices_and_best_of(client, server):
    # n=3 with seeds: choice i equals a single request with seed + i
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, n=3, seed=40, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [client.completions.create(model="m", prompt=PROMPT, max_tokens=6, seed=40 + i, temperature=1.0)
               for i in range(3)]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    # the prompt counts once, every choice's tokens count
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens
    # a list of 2 prompts with n=2: choices prompt-major, as OpenAI orders them
    out = client.completions.create(model="m", prompt=[PROMPT, "other"], max_tokens=4, n=2, seed=1, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # chat, streamed: every choice gets its role chunk, content and finish_reason
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, n=2, seed=7, temperature=1.0, stream=True)
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, n=2, seed=7, temperature=1.0)
    assert [c.message.content for c in plain.choices] == [texts[0], texts[1]]
    assert set(reasons) == {0, 1}
    # best_of: returns n, the highest cumulative logprob among best_of candidates
    best = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, n=1, best_of=4, seed=3, temperature=1.0, logprobs=0)
    cands = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, n=4, seed=3, temperature=1.0, logprobs=0)
    top = max(cands.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert len(best.choices) == 1 and best.choices[0].text == top.text


def test_vllm_extensions_min_tokens_bad_words_stop_token_ids(client, server):
    url, app = server
    tok = app.state.service.client
    base = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    # "hello" is one token of the tiny tokenizer: a huge bias makes it the greedy pick,
    # and bad_words removes it again
    [hello] = tok.encode("hello", add_special_tokens=False)
    biased = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(hello): 100})
    assert biased.choices[0].text.startswith("hello")
    banned = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(hello): 100},
                                       extra_body={"bad_words": ["hello"]})
    assert "hello" not in banned.choices[0].text
    details = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True}}).json()
    ids = [t["id"] for t in details["details"]["tokens"]]
    assert details["generated_text"] == base.choices[0].text
    stop_at = ids[2]
    stopped = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [stop_at]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3
    longer = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"stop_token_ids": [stop_at], "min_tokens": 5})
    assert longer.usage.completion_tokens >= 5
    r = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "stop_token_ids": [10**9]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "stop_token_ids"
    r = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "min_tokens": -1})
    assert r.status_code == 422
