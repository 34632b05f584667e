"""/v1/responses on the real default model (SmolLM2) with the openai SDK: the greedy answer,
streamed and not, is the chat route's answer to the same message."""

import pytest
from server_utils import running_server

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(smollm2_dir):
    from openai import OpenAI

    engine = {"num_kv_blocks": 256, "block_size": 16}
    with running_server(smollm2_dir, engine=engine, max_total_tokens=1024) as (url, _):
        with OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c


def test_responses_answer_equals_the_chat_answer(client):
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    r = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.output_text == answer
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(model="smollm2", input=[{"role": "user", "content": QUESTION}],
                                 max_output_tokens=24, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == answer
