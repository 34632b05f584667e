"""Contract tests with the clients people call OpenAI-compatible servers with (issue 33
item 8): LangChain's ChatOpenAI (chat and Responses) and OpenAIEmbeddings, LiteLLM
(completion, embedding) and the Vercel AI SDK (text, objects, tools, embeddings), each run as its docs show
against a real `ember serve` (uvicorn, an API key) on the tiny random model. Greedy
answers stream and arrive whole alike; tools are forced by name (a grammar writes the
call, so a random model calls too); structured outputs validate against their schemas.
The same checks on SmolLM2: tests/test_clients_smollm2.py."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from client_apps import WEATHER, ai_sdk_dir, langchain_calls, litellm_calls, run_ai_sdk
from server_utils import running_server
from tiny_models import with_context

KEY = "sekrit"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    path = with_context(tiny_llama_dir, tmp_path_factory.mktemp("tiny-clients") / "model", 2048)
    with running_server(path, engine={"num_kv_blocks": 1024}, max_total_tokens=2048, served_model_name="tiny",
                        api_key=KEY) as running:
        yield running


def _unit_vectors(vectors: list[list[float]], count: int) -> None:
    """``count`` vectors of one width, each of length 1 (normalised)."""
    assert len(vectors) == count and len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 1
    for vector in vectors:
        assert abs(math.fsum(x * x for x in vector) - 1.0) < 1e-3


def check_langchain(got: dict) -> None:
    assert got["invoke"] and got["stream"] == got["invoke"]
    assert got["responses"] == got["invoke"] and got["responses_stream"] == got["responses"]  # the same greedy text
    _unit_vectors(got["documents"] + [got["query"]], 4)
    assert max(abs(a - b) for a, b in zip(got["query"], got["documents"][0])) < 1e-4
    assert got["finish_reason"] in ("length", "stop")
    assert got["usage"]["output_tokens"] > 0 and got["usage"]["input_tokens"] > 0
    [call] = got["tool_calls"]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER)
    assert len(got["structured"].name) <= 12 and 0 <= got["structured"].population <= 99_999_999


def check_litellm(got: dict) -> None:
    assert got["text"] and got["stream"] == got["text"]
    assert got["finish_reason"] in ("length", "stop") and got["usage"].completion_tokens > 0
    [call] = got["tool_calls"]
    assert call.function.name == "get_weather" and got["tool_finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    _unit_vectors(got["embeddings"], 2)


def check_ai_sdk(got: dict) -> None:
    text, streamed = got["generateText"], got["streamText"]
    assert text["text"] and streamed["text"] == text["text"]
    assert text["finishReason"] in ("length", "stop") and streamed["finishReason"] == text["finishReason"]
    assert text["usage"]["outputTokens"] > 0 and text["usage"]["inputTokens"] > 0
    city = got["generateObject"]["object"]
    assert len(city["name"]) <= 12 and city["country"] in ("France", "Japan", "Peru")
    assert isinstance(city["population"], int)
    [call] = got["toolCall"]["calls"]
    assert call["toolName"] == "get_weather" and call["toolCallId"] and got["toolCall"]["finishReason"] == "tool-calls"
    jsonschema.validate(call["input"], WEATHER)
    _unit_vectors([got["embeddings"]["one"], *got["embeddings"]["many"]], 4)
    assert max(abs(a - b) for a, b in zip(got["embeddings"]["one"], got["embeddings"]["many"][0])) < 1e-4


def test_langchain_chat_openai(server):
    check_langchain(langchain_calls(server.url, "tiny", KEY))


def test_litellm_completion(server):
    check_litellm(litellm_calls(server.url, "tiny", KEY))


def test_vercel_ai_sdk(server):
    check_ai_sdk(run_ai_sdk(ai_sdk_dir(), server.url, "tiny", KEY))
