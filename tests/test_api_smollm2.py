"""End to end: the real default model behind the real server, with the clients users have."""

import json

import httpx
import pytest

from server_utils import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with running_server(smollm2_dir, engine={"num_kv_blocks": 256, "block_size": 16}, max_total_tokens=1024) as (url, app):
        yield url, app


def test_openai_chat_answers_sensibly(server):
    from openai import OpenAI

    url, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens > 5 and chat.usage.completion_tokens <= 24
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content


def test_tgi_stream_equals_generate_on_multibyte_output(server):
    url, _ = server
    inputs = "<|im_start|>user\nWrite three emoji and the Japanese word for cat.<|im_end|>\n<|im_start|>assistant\n"
    params = {"max_new_tokens": 32}
    plain = httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": params}, timeout=120).json()
    r = httpx.post(f"{url}/generate_stream", json={"inputs": inputs, "parameters": params}, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["token"]["text"] for e in events) == plain["generated_text"] == events[-1]["generated_text"]
    assert any(ord(ch) > 0x2000 for ch in plain["generated_text"]), plain["generated_text"]


def test_huggingface_hub_client_with_details(server):
    from huggingface_hub import InferenceClient

    url, _ = server
    client = InferenceClient(base_url=url)
    out = client.text_generation("The capital of France is", max_new_tokens=8, details=True)
    assert out.details.generated_tokens == len(out.details.tokens) <= 8
    assert "".join(client.text_generation("The capital of France is", max_new_tokens=8, stream=True)) == out.generated_text
