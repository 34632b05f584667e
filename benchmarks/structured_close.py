"""Structured outputs that always close (issue 33 item 7), measured on SmolLM2.

Twelve held-out JSON schemas (in no test but tests/test_grammar_budget_smollm2.py, which
takes a few): nested objects, arrays with minItems/maxItems, enums, numbers with bounds,
free strings, optional fields; person, address, order, event, product, config shapes.
Each is asked of SmolLM2 through the openai client (``response_format`` json_schema,
``max_tokens`` 120) at temperature 0, 0.7 and 1.0, against ``ember serve`` twice:

* ``before``: ``--disable-grammar-budget --grammar-repetition-limit 0`` (the old behaviour;
  ``EngineConfig(grammar_budget=False, grammar_repetition_limit=0)``);
* ``after``: the defaults (budget on, repetition limit 12);
* ``repetition_only``, ``budget_only`` (``--arms``): one of the two.

Schemas with ``minimum``/``maximum`` (review, sensor) run on xgrammar (outlines refuses
the bounds; the engine falls back), whose budget is the greedy closing walk.

An answer passes when its finish reason is ``stop`` (so the openai SDK's ``parse()``
raises no ``LengthFinishReasonError``) and it validates against its schema
(jsonschema). Prints the pass counts per arm and temperature, each failure, and writes
JSON (``--out``).

    python benchmarks/structured_close.py [--max-tokens 120] [--out structured_close.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

HELD_OUT = {
    "person": {"type": "object", "properties": {
        "first_name": {"type": "string"}, "last_name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"}, "nickname": {"type": "string"}},
        "required": ["first_name", "last_name", "age"]},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}, "postcode": {"type": "string"},
        "country": {"enum": ["FR", "DE", "US", "JP"]}}, "required": ["street", "city", "postcode", "country"]},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "string"},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "product": {"type": "string"}, "quantity": {"type": "integer"}}, "required": ["product", "quantity"]}},
        "paid": {"type": "boolean"}}, "required": ["order_id", "lines", "paid"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string"}, "date": {"type": "string", "format": "date"}, "location": {"type": "string"},
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["title", "date", "location"]},
    "product": {"type": "object", "properties": {
        "name": {"type": "string"}, "price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "in_stock": {"type": "boolean"}}, "required": ["name", "price", "currency", "tags", "in_stock"]},
    "config": {"type": "object", "properties": {
        "service": {"type": "string"}, "replicas": {"type": "integer"},
        "env": {"type": "object", "properties": {"debug": {"type": "boolean"}, "log_level": {
            "enum": ["debug", "info", "warning", "error"]}}, "required": ["debug", "log_level"]},
        "note": {"type": "string"}}, "required": ["service", "replicas", "env"]},
    "review": {"type": "object", "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": {"type": "string"},
        "pros": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["rating", "summary"]},
    "sensor": {"type": "object", "properties": {
        "id": {"type": "string"}, "reading": {"type": "number", "minimum": -50, "maximum": 150},
        "unit": {"enum": ["C", "F"]}}, "required": ["id", "reading", "unit"]},
    "book": {"type": "object", "properties": {
        "title": {"type": "string"}, "authors": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                 "maxItems": 2},
        "year": {"type": "integer"}, "isbn": {"type": "string"}}, "required": ["title", "authors", "year"]},
    "recipe": {"type": "object", "properties": {
        "dish": {"type": "string"}, "servings": {"type": "integer"},
        "ingredients": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "object", "properties": {
            "item": {"type": "string"}, "grams": {"type": "number"}}, "required": ["item", "grams"]}}},
        "required": ["dish", "servings", "ingredients"]},
    "ticket": {"type": "object", "properties": {
        "subject": {"type": "string"}, "priority": {"enum": ["low", "medium", "high"]},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                     "required": ["name"]},
        "body": {"type": "string"}}, "required": ["subject", "priority", "customer", "body"]},
    "trip": {"type": "object", "properties": {
        "from": {"type": "string"}, "to": {"type": "string"},
        "legs": {"type": "array", "items": {"type": "object", "properties": {
            "mode": {"enum": ["train", "plane", "bus"]}, "hours": {"type": "number"}},
            "required": ["mode", "hours"]}, "minItems": 1, "maxItems": 3},
        "notes": {"type": "string"}}, "required": ["from", "to", "legs"]},
}
TEMPERATURES = (0.0, 0.7, 1.0)
ARMS = {  # EngineConfig fields of each arm
    "before": {"grammar_budget": False, "grammar_repetition_limit": 0},
    "after": {},
    "repetition_only": {"grammar_budget": False},
    "budget_only": {"grammar_repetition_limit": 0},
}


def ask(client, name: str, schema: dict, temperature: float, max_tokens: int, seed: int) -> dict:
    import jsonschema

    reply = client.chat.completions.create(
        model="default", max_tokens=max_tokens, temperature=temperature, seed=seed,
        messages=[{"role": "user", "content": f"Write one {name} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    )
    choice = reply.choices[0]
    text = choice.message.content or ""
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {"schema": name, "temperature": temperature, "finish_reason": choice.finish_reason, "valid": valid,
            "passed": valid and choice.finish_reason == "stop", "tokens": reply.usage.completion_tokens,
            "text": text}


def run_arm(model_dir, arm: dict, schemas: dict, temperatures, max_tokens: int, seed: int) -> list[dict]:
    from openai import OpenAI

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from server_utils import running_server

    engine = {"num_kv_blocks": 512, "block_size": 16, **arm}
    with running_server(model_dir, engine=engine, max_total_tokens=2048) as (url, _), \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        jobs = [(name, schema, t) for name, schema in schemas.items() for t in temperatures]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: ask(client, *job, max_tokens, seed), jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="before,after", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from ember.weights import resolve_model

    model_dir = resolve_model(None, None)
    results = {}
    for arm in args.arms.split(","):
        started = time.perf_counter()
        rows = run_arm(model_dir, ARMS[arm], HELD_OUT, TEMPERATURES, args.max_tokens, args.seed)
        results[arm] = {"seconds": round(time.perf_counter() - started, 1), "rows": rows,
                        "passed": sum(r["passed"] for r in rows), "total": len(rows)}
        by_t = {t: sum(r["passed"] for r in rows if r["temperature"] == t) for t in TEMPERATURES}
        print(f"{arm}: {results[arm]['passed']}/{len(rows)} pass (stop and valid) in {results[arm]['seconds']} s; "
              f"per temperature {by_t}; finish length: {sum(r['finish_reason'] == 'length' for r in rows)}")
        for r in rows:
            if not r["passed"]:
                print(f"  FAIL {r['schema']} t={r['temperature']} {r['finish_reason']} valid={r['valid']}: "
                      f"{r['text'][-90:]!r}")
    if args.out:
        Path(args.out).write_text(json.dumps({"max_tokens": args.max_tokens, "arms": results}, indent=1))


if __name__ == "__main__":
    main()
