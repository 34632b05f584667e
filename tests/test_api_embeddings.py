"""/v1/embeddings end to end: a real server, the official openai SDK (float and its
default base64), transformers' AutoModel as the oracle, and every bad input as a 4xx
naming the field in OpenAI's error shape."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from server_utils import running_server
from test_pooling import make_base_model, write_sentence_transformers

from ember.api.routes.pooling import MAX_INPUTS
from ember.testing.tiny_models import VOCAB_SIZE

MAX_CONCURRENT = 6
MAX_TOTAL = 256


def create_embed_model(path):
    """A tiny Qwen3Model with a sentence-transformers config (mean pooling, normalised), Matryoshka."""
    hf = make_base_model("qwen3", path, seed=3)
    write_sentence_transformers(path, "mean", normalize=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return path, hf


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return create_embed_model(tmp_path_factory.mktemp("qwen3-embed"))


@pytest.fixture(scope="module")
def server(embed_model):
    path, _ = embed_model
    with running_server(path, engine={"max_num_batched_tokens": 16}, served_model_name="tiny-embed",
                        max_concurrent_requests=MAX_CONCURRENT, max_total_tokens=MAX_TOTAL) as srv:
        yield srv


def oracle(hf, tokenizer, text: str | list[int], kind: str = "mean", dimensions: int | None = None) -> np.ndarray:
    ids = tokenizer.encode(text) if isinstance(text, str) else text
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden.mean(0) if kind == "mean" else hidden[-1]
    return F.normalize(vector[:dimensions] if dimensions else vector, dim=0).numpy()


def assert_close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    assert float(got @ want) / float(np.linalg.norm(got) * np.linalg.norm(want)) > 0.9999
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_openai_client_embeddings_float_and_base64(server, embed_model):
    path, hf = embed_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = ["the quick brown fox jumps over the lazy dog " * 2, "hello", "embeddings"]
    default = client.embeddings.create(model="tiny-embed", input=texts)  # the SDK asks for base64 by default
    floats = client.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    for response in (default, floats):
        assert response.model == "tiny-embed"
        assert [d.index for d in response.data] == [0, 1, 2]
        num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
        assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
        for text, item in zip(texts, response.data):
            assert_close(item.embedding, oracle(hf, tokenizer, text))
    single = client.embeddings.create(model="tiny-embed", input="hello", encoding_format="float")
    assert_close(single.data[0].embedding, oracle(hf, tokenizer, "hello"))
    ids = tokenizer.encode("token ids in")
    by_ids = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    assert_close(by_ids.data[0].embedding, oracle(hf, tokenizer, ids))
    lists = client.embeddings.create(model="tiny-embed", input=[ids, ids[:3]], user="someone")
    assert_close(lists.data[1].embedding, oracle(hf, tokenizer, ids[:3]))
    assert lists.usage.prompt_tokens == len(ids) + 3


def test_a_batch_larger_than_the_in_flight_limit_and_the_window_takes_one_slot(server, embed_model, monkeypatch):
    """LangChain sends up to 1,000 texts a call: one request, one slot of
    --max-concurrent-requests, its inputs at most `WINDOW` at a time in the engine."""
    import ember.api.routes.pooling as pooling

    monkeypatch.setattr(pooling, "WINDOW", 4)
    path, hf = embed_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = [f"text number {i}" for i in range(MAX_CONCURRENT * 5)]
    seen: list[int] = []
    service = server.app.state.service
    generate = service.generate

    async def counting(*args, **kwargs):
        seen.append(service.client.num_requests)
        async for out in generate(*args, **kwargs):
            yield out

    monkeypatch.setattr(service, "generate", counting)
    r = httpx.post(server.url + "/v1/embeddings", timeout=120,
                   json={"model": "m", "input": texts, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    for text, item in zip(texts, r.json()["data"]):
        assert_close(item["embedding"], oracle(hf, tokenizer, text))
    assert len(seen) == len(texts) and max(seen) <= 4  # never more than the window in the engine
    assert service.num_in_flight == 0


def test_base64_is_little_endian_float32(server, embed_model):
    path, hf = embed_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    body = httpx.post(server.url + "/v1/embeddings", json={"model": "x", "input": "hello", "encoding_format": "base64"})
    assert body.status_code == 200
    data = body.json()["data"][0]["embedding"]
    assert isinstance(data, str)
    assert_close(np.frombuffer(base64.b64decode(data), dtype="<f4"), oracle(hf, tokenizer, "hello"))


def test_dimensions_truncate_and_renormalise(server, embed_model):
    path, hf = embed_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    response = client.embeddings.create(model="tiny-embed", input="hello there", dimensions=16)
    assert len(response.data[0].embedding) == 16
    assert_close(response.data[0].embedding, oracle(hf, tokenizer, "hello there", dimensions=16))


BAD = [
    ({"model": "m", "input": ""}, 422, "input"),
    ({"model": "m", "input": []}, 422, "input"),
    ({"model": "m", "input": [""]}, 422, "input[0]"),
    ({"model": "m", "input": ["a", ""]}, 422, "input[1]"),
    ({"model": "m", "input": [[]]}, 422, "input[0]"),
    ({"model": "m", "input": [1, VOCAB_SIZE]}, 422, "input"),
    ({"model": "m", "input": [[1], [-1]]}, 422, "input[1]"),
    ({"model": "m", "input": "x" * (MAX_TOTAL + 10)}, 422, "input"),
    ({"model": "m", "input": ["a"] * (MAX_INPUTS + 1)}, 422, "input"),
    ({"model": "m", "input": 5}, 422, "input"),
    ({"model": "m", "input": [1, "a"]}, 422, "input"),
    ({"model": "m", "input": None}, 422, "input"),
    ({"model": "m"}, 422, "input"),
    ({"input": "a"}, 422, "model"),
    ({"model": "m", "input": "a", "encoding_format": "hex"}, 422, "encoding_format"),
    ({"model": "m", "input": "a", "dimensions": 0}, 422, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": 65}, 400, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": "8"}, 422, "dimensions"),
    ({"model": "m", "input": "a", "truncate": 3}, 422, "truncate"),
    ({"model": "m", "input": "a", "user": 7}, 422, "user"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, param):
    response = httpx.post(server.url + "/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]


def test_a_generation_model_embeds_with_its_last_token_and_refuses_dimensions(tiny_llama_dir):
    """Any causal LM can embed (last-token pooling, normalised: the default without a
    sentence-transformers config); it is not Matryoshka, so `dimensions` is a 400.
    The engine core runs in its own process here."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    with running_server(tiny_llama_dir, engine_mode="process") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        response = client.embeddings.create(model="any", input=["Hello there", "more"], encoding_format="float")
        for text, item in zip(["Hello there", "more"], response.data):
            assert_close(item.embedding, oracle(hf.model, tokenizer, text, kind="last"))
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model="any", input="Hello", dimensions=8)
        assert info.value.body["param"] == "dimensions"


def test_the_routes_are_in_the_openapi_document(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    components = spec["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        return components[schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else schema

    for path, field in (("/v1/embeddings", "input"), ("/v1/rerank", "documents"), ("/rerank", "documents"),
                        ("/v1/score", "text_1")):
        op = spec["paths"][path]["post"]
        assert field in resolve(op["requestBody"]["content"]["application/json"]["schema"])["properties"]
        assert "error" in resolve(op["responses"]["422"]["content"]["application/json"]["schema"])["properties"]
