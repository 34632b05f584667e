"""/v1/rerank, /rerank and /v1/score end to end: embedding cosine similarity on an
embedding model, yes/no next-token logits under --score-template on a causal LM, each
checked against transformers on the same weights; every bad input a 4xx naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import transformers
from server_utils import running_server
from test_api_embeddings import MAX_CONCURRENT, create_embed_model, oracle

from ember.api.pooling import create_score_template
from ember.api.routes.pooling import MAX_INPUTS

DOCS = ["a fox in the forest", "stock market report", "the quick brown fox", "weather tomorrow"]
QUERY = "quick fox"


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return create_embed_model(tmp_path_factory.mktemp("qwen3-rerank"))


@pytest.fixture(scope="module")
def server(embed_model):
    path, _ = embed_model
    with running_server(path, engine={"max_num_batched_tokens": 16}, served_model_name="tiny-embed",
                        max_concurrent_requests=MAX_CONCURRENT) as srv:
        yield srv


def cosines(hf, tokenizer, query: str, docs: list[str]) -> list[float]:
    q = oracle(hf, tokenizer, query)
    return [float(q @ oracle(hf, tokenizer, d)) for d in docs]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_orders_documents_by_embedding_cosine(server, embed_model, path):
    model_dir, hf = embed_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = cosines(hf, tokenizer, QUERY, DOCS)
    body = httpx.post(server.url + path, json={"model": "tiny-embed", "query": QUERY, "documents": DOCS}).json()
    assert body["model"] == "tiny-embed" and body["id"].startswith("rerank-")
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4
        assert r["document"] == {"text": DOCS[r["index"]]}
    num_tokens = len(tokenizer.encode(QUERY)) + sum(len(tokenizer.encode(d)) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    top = httpx.post(server.url + path, json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                              "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top)


def test_score_one_to_one_and_one_to_many(server, embed_model):
    model_dir, hf = embed_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    one_to_many = httpx.post(server.url + "/v1/score", json={"model": "m", "text_1": QUERY, "text_2": DOCS}).json()
    assert one_to_many["object"] == "list" and one_to_many["model"] == "tiny-embed"
    want = cosines(hf, tokenizer, QUERY, DOCS)
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in one_to_many["data"])
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], want, atol=1e-4)
    pairs = httpx.post(server.url + "/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [cosines(hf, tokenizer, a, [b])[0] for a, b in zip(DOCS[:2], DOCS[2:])], atol=1e-4)
    single = httpx.post(server.url + "/v1/score", json={"text_1": "a", "text_2": "b"}).json()
    assert len(single["data"]) == 1 and single["usage"]["prompt_tokens"] == 2


BAD = [
    ("/v1/rerank", {"documents": DOCS}, 422, "query"),
    ("/v1/rerank", {"query": QUERY}, 422, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, 422, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, 422, "documents[1]"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, 422, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": [5]}, 422, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, 422, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": "a"}, 422, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, 422, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * (MAX_INPUTS + 1)}, 422, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "rank_fields": ["x"]}, 422, "rank_fields"),
    ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": "2"}, 422, "top_n"),
    ("/v1/score", {"text_2": "a"}, 422, "text_1"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, 422, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, 422, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 422, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": [""]}, 422, "text_2[0]"),
    ("/v1/score", {"text_1": 1, "text_2": "a"}, 422, "text_1"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{p}{i}" for i, (_, _, _, p) in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, status, param):
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]  # OpenAI's shape, /rerank included
    assert error["param"] == param, error


TEMPLATE = "Query: {query}\nDocument: {document}\nRelevant:"


def test_yes_no_logits_scoring_under_a_template(tiny_llama_dir):
    """--score-template: each pair's prompt, scored P(yes) / (P(yes) + P(no)) from the
    next-token logits at its last position (Qwen3-Reranker's way), nothing generated."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    yes, no = tokenizer.encode("Y", add_special_tokens=False)[0], tokenizer.encode("N", add_special_tokens=False)[0]

    def want(query: str, doc: str) -> float:
        ids = tokenizer.encode(TEMPLATE.replace("{query}", query).replace("{document}", doc))
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[yes, no]].float(), dim=0)[0])

    with running_server(tiny_llama_dir, score_template=TEMPLATE, score_tokens="Y,N") as srv:
        body = httpx.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
        expected = [want(QUERY, d) for d in DOCS]
        assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
        for r in body["results"]:
            assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
        scores = httpx.post(srv.url + "/v1/score", json={"text_1": [QUERY, "x"], "text_2": DOCS[:2]}).json()["data"]
        np.testing.assert_allclose([d["score"] for d in scores], [want(QUERY, DOCS[0]), want("x", DOCS[1])], atol=1e-4)
        assert httpx.get(srv.url + "/health").status_code == 200


def test_score_template_settings_are_checked(tiny_llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert create_score_template(None, None, tokenizer.encode) is None
    with pytest.raises(ValueError, match="--score-template"):
        create_score_template("no placeholders {query}", "Y,N", tokenizer.encode)
    with pytest.raises(ValueError, match="--score-tokens"):
        create_score_template(TEMPLATE, None, tokenizer.encode)  # "yes" is three byte tokens here
    with pytest.raises(ValueError, match="--score-tokens"):
        create_score_template(TEMPLATE, "Y", tokenizer.encode)
    assert create_score_template(TEMPLATE, "Y,N", tokenizer.encode).prompt("q", "d") == "Query: q\nDocument: d\nRelevant:"
