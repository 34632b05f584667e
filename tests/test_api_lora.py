"""LoRA adapters through the HTTP API (issue 32), on a real server (tiny random Llama,
random peft adapters): the OpenAI `model` field and TGI's `adapter_id` select an adapter
and give exactly transformers + peft's greedy tokens; unknown names are 404s listing what
is served; /v1/models lists each adapter with its parent; vLLM's load/unload routes
(behind --enable-lora-runtime-updates and the API key) and every bad input of the issue;
the flags and variables (--lora-modules, EMBER_LORA_MODULES, TGI's LORA_ADAPTERS); the
metrics, the access log and the span attribute."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time

import httpx
import openai
import peft  # in the test extras
import pytest
import torch
import transformers
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_utils import running_server, wait_idle

from ember.api.cli import build_parser, main
from ember.api.cli_env import apply_defaults
from ember.api.lora import LoRAModule
from ember.api.settings import ServerSettings, engine_config_kwargs

KEY = "lora-Key_0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW = 8
PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": "say something"}]
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(hf_model, path, rank, targets, seed, **extra):
    """A peft LoRA with random A and B (B scaled up so that greedy tokens change), saved at ``path``."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                module.lora_B["default"].weight.mul_(4.0)
    model.save_pretrained(path)
    return model.eval()


def rewrite(src, dst, change):
    """A copy of the adapter at ``src`` whose tensors ``change(tensors)`` returns."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    save_file(change(tensors), str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def lora(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("api-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    oracles = {
        "sql": save_adapter(base, root / "sql", 8, ["q_proj", "v_proj"], seed=1),
        "tone": save_adapter(base, root / "tone", 16, ALL_MODULES, seed=2, use_rslora=True),
        "late": save_adapter(base, root / "late", 4, ["o_proj", "down_proj", "up_proj"], seed=3),
        None: base,
    }
    save_adapter(base, root / "r32", 32, ["q_proj"], seed=4)  # above --max-lora-rank 16
    rewrite(root / "sql", root / "wide", lambda t: {  # trained for a base whose q_proj is wider
        k: torch.zeros(v.shape[0], 96) if "q_proj.lora_A" in k else v for k, v in t.items()})
    rewrite(root / "sql", root / "alien", lambda t: {k.replace("q_proj", "foo_proj"): v for k, v in t.items()})
    shutil.copytree(root / "sql", root / "damaged")
    (root / "damaged" / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken")
    shutil.copytree(root / "sql", root / "noconfig")
    (root / "noconfig" / "adapter_config.json").unlink()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    return root, oracles, tokenizer


def peft_greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture(scope="module")
def server(tiny_llama_dir, lora, spans):
    root = lora[0]
    engine = {"enable_lora": True, "lora_modules": {"sql": str(root / "sql"), "tone": str(root / "tone")},
              "max_loras": 2, "max_lora_rank": 16}
    modules = [LoRAModule("sql", str(root / "sql")), LoRAModule("tone", str(root / "tone"), "tiny-v2")]
    with running_server(tiny_llama_dir, engine=engine, tracer_provider=spans[0], max_total_tokens=256,
                        served_model_name="tiny", api_key=KEY, enable_lora_runtime_updates=True,
                        lora_modules=modules, max_loras=2) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def expected_text(lora, server, adapter, prompt=PROMPT, chat=False):
    _, oracles, tokenizer = lora
    service = server.app.state.service
    if chat:
        prompt = service.client.apply_chat_template(MESSAGES, None)
    ids = service.encode(prompt, add_special_tokens=not chat)
    return tokenizer.decode(peft_greedy(oracles[adapter], ids), skip_special_tokens=True)


def generate(http, adapter_id="absent", stream=False, path=None, max_new_tokens=NEW):
    parameters = {"max_new_tokens": max_new_tokens, "details": not stream}
    if adapter_id != "absent":
        parameters["adapter_id"] = adapter_id
    return http.post(path or ("/generate_stream" if stream else "/generate"),
                     json={"inputs": PROMPT, "parameters": parameters})


# -- selection -----------------------------------------------------------------------------
def test_the_model_field_selects_the_adapter_on_the_openai_routes(server, client, lora):
    texts = {}
    for model, adapter in [("sql", "sql"), ("tone", "tone"), ("tiny", None)]:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert r.model == model and r.choices[0].text == expected_text(lora, server, adapter), model
        texts[model] = r.choices[0].text
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW, temperature=0)
        assert chat.choices[0].message.content == expected_text(lora, server, adapter, chat=True), model
    assert len(set(texts.values())) == 3, "each adapter changes the greedy answer"
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == texts["sql"]


def test_adapter_id_selects_the_adapter_on_the_tgi_routes(server, http, lora):
    service = server.app.state.service
    ids = service.encode(PROMPT)
    oracles = lora[1]
    for adapter_id, adapter in [("sql", "sql"), ("tone", "tone"), (None, None), ("absent", None), ("tiny", None)]:
        r = generate(http, adapter_id)
        assert r.status_code == 200, r.text
        got = [t["id"] for t in r.json()["details"]["tokens"]]
        assert got == peft_greedy(oracles[adapter], ids), adapter_id
    streamed = generate(http, "tone", stream=True)
    events = [json.loads(line[5:]) for line in streamed.text.splitlines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == peft_greedy(oracles["tone"], ids)
    compat = http.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "adapter_id": "sql"}})
    assert compat.json()["generated_text"] == expected_text(lora, server, "sql")


def test_unknown_names_are_404s_listing_what_is_served(http):
    for path, body in [("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES, "max_tokens": 2})]:
        for stream in (False, True):
            r = http.post(path, json={**body, "stream": stream})
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["type"] == "not_found_error"
            assert error["param"] == "model"
            assert "`nope` does not exist; served models: tiny, sql, tone" in error["message"]
    for stream in (False, True):
        r = generate(http, "nope", stream=stream)
        assert r.status_code == 404 and r.json() == {
            "error": "adapter 'nope' is not loaded; loaded adapters: sql, tone", "error_type": "adapter_not_found"}
    assert generate(http, "sql").status_code == 200


def test_models_lists_the_base_and_each_adapter_with_its_parent(http, lora):
    root = lora[0]
    data = http.get("/v1/models").json()["data"]
    base, *adapters = data
    assert base["id"] == "tiny" and base["parent"] is None and base["max_model_len"] == 256 and base["root"]
    assert {(a["id"], a["parent"], a["root"], a["object"]) for a in adapters} == {
        ("sql", "tiny", str(root / "sql"), "model"), ("tone", "tiny-v2", str(root / "tone"), "model")}
    assert all(a["owned_by"] == "ember" and isinstance(a["created"], int) for a in adapters)


# -- load and unload at run time -----------------------------------------------------------
def test_load_use_and_unload_an_adapter_at_run_time(server, http, client, lora):
    root = lora[0]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    late = [m for m in http.get("/v1/models").json()["data"] if m["id"] == "late"]
    assert late and late[0]["parent"] == "tiny" and late[0]["root"] == str(root / "late")
    completion = client.completions.create(model="late", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert completion.choices[0].text == expected_text(lora, server, "late")
    assert generate(http, "late").json()["generated_text"] == expected_text(lora, server, "late")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError, match="served models: tiny, sql, tone"):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "adapter 'late' is not loaded; loaded adapters: sql, tone"


def test_runtime_updates_need_the_api_key(server):
    for path, body in [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert set(server.app.state.service.client.adapters()) == {"sql", "tone"}


BAD_LOADS = [  # (what, body (paths under the fixture's root), status, error code, words of the message)
    ("rank above --max-lora-rank", {"lora_name": "big", "lora_path": "r32"}, 400, "invalid_adapter",
     "rank 32, above max_lora_rank 16"),
    ("another base's shapes", {"lora_name": "wide", "lora_path": "wide"}, 400, "invalid_adapter",
     "q_proj' maps 96 -> 64 features but the model's maps 64 -> 64"),
    ("a module the model lacks", {"lora_name": "alien", "lora_path": "alien"}, 400, "invalid_adapter",
     "foo_proj', which this model does not have"),
    ("missing directory", {"lora_name": "gone", "lora_path": "nowhere"}, 400, "invalid_adapter", "not a directory"),
    ("damaged weights", {"lora_name": "bad", "lora_path": "damaged"}, 400, "invalid_adapter", "is damaged"),
    ("no adapter_config.json", {"lora_name": "bare", "lora_path": "noconfig"}, 400, "invalid_adapter",
     "no adapter_config.json"),
    ("a name loaded twice", {"lora_name": "sql", "lora_path": "tone"}, 400, "invalid_adapter",
     "'sql' is already loaded"),
    ("the served model's name", {"lora_name": "tiny", "lora_path": "tone"}, 400, "bad_request",
     "is the served model's name"),
    ("a name with a space", {"lora_name": "two words", "lora_path": "tone"}, 400, "invalid_adapter",
     "adapter name must be"),
    ("no lora_path", {"lora_name": "x"}, 422, "validation", "missing field `lora_path`"),
    ("an empty name", {"lora_name": "", "lora_path": "tone"}, 422, "validation", "`lora_name`"),
    ("a number for a name", {"lora_name": 5, "lora_path": "tone"}, 422, "validation", "`lora_name`"),
    ("an unknown field", {"lora_name": "x", "lora_path": "tone", "lora_int_id": 3}, 422, "validation",
     "unknown field `lora_int_id`"),
]


@pytest.mark.parametrize("what, body, status, code, words", BAD_LOADS, ids=[b[0] for b in BAD_LOADS])
def test_every_bad_load_is_a_4xx_naming_the_problem(http, lora, what, body, status, code, words):
    if "lora_path" in body:
        body = {**body, "lora_path": str(lora[0] / body["lora_path"])}
    r = http.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and words in error["message"], error
    assert generate(http, "sql").status_code == 200  # the server goes on serving
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "sql", "tone"]


def test_bad_unloads_and_malformed_bodies(http):
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "adapter 'nope' is not loaded; loaded adapters: sql, tone", "type": "not_found_error",
        "param": "lora_name", "code": "adapter_not_found"}
    r = http.post("/v1/unload_lora_adapter", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = http.post("/v1/unload_lora_adapter", json={})
    assert r.status_code == 422 and r.json()["error"]["message"] == "missing field `lora_name`"
    r = http.post("/v1/load_lora_adapter", json=["sql"])
    assert r.status_code == 422 and "JSON object" in r.json()["error"]["message"]
    assert generate(http, "tone").status_code == 200


def test_the_routes_are_documented(http):
    spec = http.get("/openapi.json").json()
    for path, schema in [("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
                         ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest")]:
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(schema)
        assert {"200", "400", "401", "404", "422"} <= set(op["responses"])
        assert "text/plain" in op["responses"]["200"]["content"]
    assert "404" in spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "lora_path" in spec["components"]["schemas"]["LoadLoRAAdapterRequest"]["properties"]


def test_runtime_routes_are_off_without_the_flag_and_refused_without_lora(tiny_llama_dir, lora):
    root = lora[0]
    engine = {"lora_modules": {"sql": str(root / "sql")}}
    with running_server(tiny_llama_dir, engine=engine, max_total_tokens=64) as (url, _):
        for path, body in [("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(root / "late")}),
                           ("/v1/unload_lora_adapter", {"lora_name": "sql"})]:
            r = httpx.post(url + path, json=body)
            assert r.status_code == 404 and "start the server with --enable-lora-runtime-updates" in r.text
        parameters = {"max_new_tokens": 2, "adapter_id": "sql"}
        assert httpx.post(url + "/generate", json={"inputs": "x", "parameters": parameters}).status_code == 200
    with running_server(tiny_llama_dir, max_total_tokens=64, enable_lora_runtime_updates=True) as (url, _):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")})
        assert r.status_code == 400 and "start the server with --enable-lora" in r.json()["error"]["message"]
        r = httpx.post(url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2, "adapter_id": "a"}})
        assert r.status_code == 404 and "LoRA adapters are off" in r.json()["error"]
        # adapters off: any model name is the base model, as before adapters existed
        r = httpx.post(url + "/v1/completions", json={"model": "anything", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "anything"
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [str(tiny_llama_dir)]


def test_runtime_updates_with_the_core_in_its_own_process(tiny_llama_dir, lora):
    """`ember serve`'s default engine mode: the adapter is read by the server and sent over the pipe."""
    root, oracles, tokenizer = lora
    with running_server(tiny_llama_dir, engine={"enable_lora": True}, engine_mode="process", max_total_tokens=64,
                        enable_lora_runtime_updates=True) as (url, app):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "late")})
        assert r.status_code == 200, r.text
        ids = app.state.service.encode(PROMPT)
        r = httpx.post(url + "/generate", timeout=60, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "adapter_id": "late", "details": True}})
        assert [t["id"] for t in r.json()["details"]["tokens"]] == peft_greedy(oracles["late"], ids)
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "late", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and "served models: " in r.json()["error"]["message"]


# -- metrics, access log, traces -----------------------------------------------------------
def scrape(url) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_per_adapter_metrics_and_lora_requests_info(server, http, client):
    def lora_counts(samples, adapter):
        return (samples.get(("ember_lora_requests_total", (("adapter", adapter),)), 0),
                samples.get(("ember_lora_generation_tokens_total", (("adapter", adapter),)), 0))

    wait_idle(server.app)
    before = scrape(server.url)
    generate(http, "sql")
    client.completions.create(model="sql", prompt=PROMPT, max_tokens=3, temperature=0)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    wait_idle(server.app)
    after = scrape(server.url)
    got, was = lora_counts(after, "sql"), lora_counts(before, "sql")
    assert (got[0] - was[0], got[1] - was[1]) == (2, NEW + 3)
    assert not any(name.startswith("ember_lora") and ("adapter", "tiny") in labels for name, labels in after)
    [(labels, value)] = [(dict(k[1]), v) for k, v in after.items() if k[0] == "ember_lora_requests_info"]
    assert labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
    assert abs(value - time.time()) < 60
    # while a request of `tone` runs, the gauge names it (read in-process: a scrape takes longer than a step)
    registry = server.app.state.metrics.registry
    seen = set()
    with http.stream("POST", "/generate_stream",
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": 240, "adapter_id": "tone"}}) as r:
        for line in r.iter_lines():
            family = next(f for f in text_string_to_metric_families(generate_latest(registry).decode())
                          if f.name == "ember_lora_requests_info")
            seen.add(family.samples[0].labels["running_lora_adapters"])
            if "tone" in seen:
                break
    assert "tone" in seen


def test_the_adapter_is_in_the_access_log_and_the_span(server, http, spans, caplog):
    exporter = spans[1]
    exporter.clear()
    with caplog.at_level(logging.INFO, logger="ember.api.access"):
        r = generate(http, "tone", max_new_tokens=2)
        base = generate(http, None, max_new_tokens=2)
        wait_idle(server.app)
    def access_record(response):
        return next(rec for rec in caplog.records if rec.name == "ember.api.access"
                    and f"(request {response.headers['x-request-id']}" in rec.getMessage())

    record = access_record(r)
    assert record.fields["adapter"] == "tone" and record.getMessage().endswith(", adapter tone)")
    assert access_record(base).fields["adapter"] is None
    finished = exporter.get_finished_spans()
    request_span = next(s for s in finished if s.attributes.get("ember.request_id") == r.headers["x-request-id"])
    assert request_span.attributes["ember.lora.adapter"] == "tone"
    generate_span = next(s for s in finished
                         if s.name == "generate" and s.parent.span_id == request_span.context.span_id)
    assert generate_span.attributes["ember.lora.adapter"] == "tone"


# -- flags and variables -------------------------------------------------------------------
def serve_args(argv, environ=None):
    args = build_parser().parse_args(["serve", *argv])
    apply_defaults(args, environ or {})
    return args


def test_lora_flags_and_variables():
    args = serve_args(["--lora-modules", "a=/x", "b=/y", "--port", "1234", "--lora-modules",
                       '{"name": "c", "path": "org/c", "base_model_name": "m"}', "--max-loras", "3",
                       "--max-lora-rank", "64", "--max-cpu-loras", "5", "--enable-lora-runtime-updates"])
    assert args.lora_modules == [LoRAModule("a", "/x"), LoRAModule("b", "/y"), LoRAModule("c", "org/c", "m")]
    assert (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (3, 64, 5)
    assert args.enable_lora_runtime_updates is True
    assert args.port == 1234 and args.enable_lora is False
    env = {"EMBER_LORA_MODULES": "a=/x  b=/y", "EMBER_ENABLE_LORA": "1", "EMBER_MAX_LORAS": "2",
           "EMBER_ENABLE_LORA_RUNTIME_UPDATES": "true", "LORA_ADAPTERS": "predibase/customer_support, d=/w"}
    args = serve_args([], env)
    assert args.lora_modules == [LoRAModule("a", "/x"), LoRAModule("b", "/y"),
                                 LoRAModule("predibase/customer_support", "predibase/customer_support"),
                                 LoRAModule("d", "/w")]
    assert (args.enable_lora, args.max_loras, args.enable_lora_runtime_updates) == (True, 2, True)
    # the flag wins over EMBER_LORA_MODULES; LORA_ADAPTERS still adds
    args = serve_args(["--lora-modules", "z=/z"], env)
    assert [m.name for m in args.lora_modules] == ["z", "predibase/customer_support", "d"]
    args = serve_args([], {"EMBER_LORA_MODULES": '[{"name": "j", "path": "/j"}, "k=/k"]'})
    assert args.lora_modules == [LoRAModule("j", "/j"), LoRAModule("k", "/k")]
    settings = ServerSettings(lora_modules=args.lora_modules, max_loras=2, max_cpu_loras=3)
    kwargs = engine_config_kwargs(settings)
    assert kwargs["lora_modules"] == (("j", "/j"), ("k", "/k")) and kwargs["enable_lora"] is True
    assert (kwargs["max_loras"], kwargs["max_lora_rank"], kwargs["max_cpu_loras"]) == (2, 16, 3)
    assert "enable_lora" not in engine_config_kwargs(ServerSettings(max_loras=3))


@pytest.mark.parametrize("argv, environ, message", [
    (["--lora-modules", "noequals"], {}, "argument --lora-modules: value 'noequals': expected NAME=PATH"),
    (["--lora-modules", '{"name": "a"}'], {}, "expected a JSON object with string fields name and path"),
    (["--lora-modules", "{oops"], {}, "argument --lora-modules: value '{oops' is not valid JSON"),
    (["--lora-modules", "a="], {}, "the path of adapter 'a' is empty"),
    (["--lora-modules", "a=/x", "a=/y"], {}, "--lora-modules / LORA_ADAPTERS name the adapter(s) 'a' more than once"),
    (["--lora-modules", "a=/x"], {"LORA_ADAPTERS": "a=/z"}, "name the adapter(s) 'a' more than once"),
    ([], {"LORA_ADAPTERS": "bad name"}, "environment variable LORA_ADAPTERS='bad name' is invalid"),
    ([], {"EMBER_LORA_MODULES": "x"}, "environment variable EMBER_LORA_MODULES='x' is invalid"),
    (["--max-loras", "0"], {}, "--max-loras must be a positive integer, got 0"),
    (["--max-lora-rank", "-8"], {}, "--max-lora-rank must be a positive integer, got -8"),
    (["--max-loras", "4", "--max-cpu-loras", "2"], {}, "--max-cpu-loras (2) must be >= --max-loras (4)"),
    ([], {"EMBER_MAX_LORAS": "many"}, "environment variable EMBER_MAX_LORAS='many' is invalid"),
])
def test_bad_lora_flags_exit_2_naming_the_flag(monkeypatch, capsys, argv, environ, message):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--model-id", "/nonexistent", *argv]) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_lora_flags_and_their_variables(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag, variable in [("--enable-lora", "EMBER_ENABLE_LORA"), ("--lora-modules", "EMBER_LORA_MODULES"),
                           ("--max-loras", "EMBER_MAX_LORAS"), ("--max-lora-rank", "EMBER_MAX_LORA_RANK"),
                           ("--max-cpu-loras", "EMBER_MAX_CPU_LORAS"),
                           ("--enable-lora-runtime-updates", "EMBER_ENABLE_LORA_RUNTIME_UPDATES")]:
        assert flag in out and variable in out
    assert "LORA_ADAPTERS" in out
