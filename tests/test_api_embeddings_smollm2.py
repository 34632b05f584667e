"""SmolLM2-135M-Instruct (a generation model) behind /v1/embeddings and /v1/rerank with
last-token pooling, normalised (the default without a sentence-transformers config).
What holds, measured: cosines of its last-token states are high for any two sentences
(0.70-0.90 for unrelated ones here) and higher still for paraphrases (0.96-0.98), so
similar sentences rank above unrelated ones and rerank puts the relevant document first;
an embedding model gives far better separated scores."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from server_utils import running_server

SIMILAR = ("The cat sat on the mat.", "A cat was sitting on the rug.")
UNRELATED = "Stock prices fell sharply on Tuesday."


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with running_server(smollm2_dir, engine={"dtype": "auto", "num_kv_blocks": 64, "block_size": 16},
                        served_model_name="smollm2", max_total_tokens=512) as srv:
        yield srv


def test_similar_sentences_have_the_higher_cosine(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    response = client.embeddings.create(model="smollm2", input=[*SIMILAR, UNRELATED])
    a, b, c = (np.asarray(d.embedding) for d in response.data)
    assert len(a) == 576 and abs(np.linalg.norm(a) - 1) < 1e-4
    assert a @ b > max(a @ c, b @ c) + 0.05


def test_rerank_puts_the_relevant_document_first(server):
    documents = ["The rocket launched into orbit.", "What is a recipe for baking bread at home?", UNRELATED]
    body = httpx.post(server.url + "/v1/rerank", json={"query": "How do I bake bread?", "documents": documents},
                      timeout=60).json()
    assert body["results"][0]["index"] == 1, body
