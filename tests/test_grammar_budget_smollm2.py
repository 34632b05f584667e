"""Structured outputs that always close, on the real default model (SmolLM2): held-out
schemas (person, order, review with integer bounds: xgrammar's closing walk) through the
openai client at max_tokens 40, where SmolLM2's free strings would otherwise run past the
limit, parse with ``chat.completions.parse`` without LengthFinishReasonError and validate.
benchmarks/structured_close.py measures twelve schemas at max_tokens 120."""

import json

import jsonschema
import pytest
from openai import OpenAI
from server_utils import running_server

pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "first_name": {"type": "string"}, "last_name": {"type": "string"}, "age": {"type": "integer"},
        "nickname": {"type": "string"}}, "required": ["first_name", "last_name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "string"},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"],
            "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["order_id", "lines", "paid"], "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": {"type": "string"}},
        "required": ["rating", "summary"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def client(smollm2_dir):
    engine = {"num_kv_blocks": 256, "block_size": 16}
    with running_server(smollm2_dir, engine=engine, max_total_tokens=2048) as (url, _), \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_held_out_schemas_close_at_a_small_max_tokens(client, name):
    schema = SCHEMAS[name]
    reply = client.chat.completions.parse(
        model="default", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": f"Write one {name} as JSON, with a long summary or note."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens <= 40
    jsonschema.validate(json.loads(choice.message.content), schema)
