"""Downloads from the Hugging Face Hub (issue 31, item 1), against a local Hub on 127.0.0.1 (tests/hub_server.py).

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import; Ember reads
them per call and passes the endpoint on, so setting HF_ENDPOINT is enough (the
conftest points it at a closed local port for the rest of the suite). No
test reaches any host but 127.0.0.1: connecting or resolving another is an error.
"""

from __future__ import annotations

import errno
import shutil
import socket

import pytest
from hub_server import HubServer, Repo

import ember
from ember.api.cli import main
from ember.sampling_params import SamplingParams
from ember.weights import HubDownloadError, ModelNotFoundError, resolve_model

NEEDED = {
    "config.json", "generation_config.json", "model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
}
NOT_NEEDED = {"README.md", "pytorch_model.bin", "original/consolidated.pt", "extra/model.safetensors"}


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    from test_weights import tiny_model, write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model())
    return path.read_bytes()


@pytest.fixture
def hub(tiny_llama_dir, tiny_gguf_bytes, tmp_path, monkeypatch):
    """A local Hub holding org/tiny (safetensors, tokenizer, and files Ember must not fetch),
    org/tiny-GGUF (two GGUF files), org/readme-only; HF_HUB_CACHE an empty folder in tmp_path."""
    import huggingface_hub.constants as hf_constants

    junk = {name: b"not needed" for name in NOT_NEEDED}
    repos = {
        "org/tiny": Repo.from_dir(tiny_llama_dir, junk),
        "org/tiny-GGUF": Repo({"tiny.Q8_0.gguf": tiny_gguf_bytes, "tiny.F32.gguf": tiny_gguf_bytes,
                               "README.md": b"# tiny"}),
        "org/readme-only": Repo({"README.md": b"# nothing here"}),
    }
    with HubServer(repos) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
        monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "ember-cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        yield server


@pytest.fixture(autouse=True)
def _only_localhost(monkeypatch):
    """No test here reaches any host but 127.0.0.1."""
    connect = socket.socket.connect

    def guarded(sock, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"network access to {address} attempted")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"name lookup of {host!r} attempted")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)


def test_download_lands_in_the_hf_cache_with_only_the_needed_files(hub, tmp_path, tiny_llama_dir):
    path = resolve_model("org/tiny", progress=False)
    commit = hub.repos["org/tiny"].branches["main"]
    assert path == tmp_path / "hf-hub" / "models--org--tiny" / "snapshots" / commit
    assert (tmp_path / "hf-hub" / "models--org--tiny" / "refs" / "main").read_text() == commit
    assert NEEDED <= {p.name for p in path.iterdir()}
    downloaded = hub.downloaded()
    assert downloaded == {p.name for p in path.iterdir()}
    assert not downloaded & NOT_NEEDED
    assert all(p.read_bytes() == (tiny_llama_dir / p.name).read_bytes() for p in path.iterdir())
    assert not any(k.lower().startswith("x-xet") for _, _, h in hub.requests for k in h)

    # cache first: the second resolve makes no HTTP request
    before = len(hub.requests)
    assert resolve_model("org/tiny", progress=False) == path
    assert len(hub.requests) == before


def test_downloaded_model_generates_as_the_local_directory(hub, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8)
    hub_llm = ember.LLM(model="org/tiny", num_kv_blocks=64)
    local_llm = ember.LLM(model=str(tiny_llama_dir), num_kv_blocks=64)
    got = hub_llm.generate("hello world", params)[0].outputs[0]
    want = local_llm.generate("hello world", params)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(want.token_ids) == 8


def test_revision_is_resolved_and_cached(hub, tmp_path):
    repo = hub.repos["org/tiny"]
    repo.branches["v1"] = repo.branches["main"]
    path = resolve_model("org/tiny", revision="v1", progress=False)
    assert path.name == repo.branches["main"]
    assert (tmp_path / "hf-hub" / "models--org--tiny" / "refs" / "v1").is_file()


def test_named_gguf_file_fetches_only_that_file_and_converts_it(hub, tmp_path):
    out = resolve_model("org/tiny-GGUF:tiny.Q8_0.gguf", progress=False)
    assert hub.downloaded() == {"tiny.Q8_0.gguf"}
    assert out.parent == tmp_path / "ember-cache" / "gguf" and (out / "config.json").is_file()
    before = len(hub.requests)
    assert resolve_model("org/tiny-GGUF", gguf_file="tiny.Q8_0.gguf", progress=False) == out
    assert len(hub.requests) == before  # cached: no request


def test_offline_with_an_empty_cache_says_so(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set") as excinfo:
        resolve_model("org/tiny", progress=False)
    assert "'org/tiny'" in str(excinfo.value) and "not cached" in str(excinfo.value)
    assert hub.requests == []


def _one_line_error(model_id: str, reason: str, **kwargs) -> str:
    with pytest.raises(HubDownloadError) as excinfo:
        resolve_model(model_id, progress=False, **kwargs)
    message = str(excinfo.value)
    assert excinfo.value.reason == reason, message
    assert "\n" not in message and repr(model_id.split(":")[0]) in message
    return message


def test_repo_not_found(hub):
    message = _one_line_error("org/missing", "not-found")
    assert "(revision main)" in message and "no such repository" in message


def test_revision_not_found(hub):
    message = _one_line_error("org/tiny", "revision-not-found", revision="v9")
    assert "(revision v9)" in message and "no such revision" in message


def test_gated_repo_needs_a_token_sent_as_bearer(hub, monkeypatch):
    hub.gated.add("org/tiny")
    message = _one_line_error("org/tiny", "gated")
    assert "HF_TOKEN" in message and "terms" in message
    assert hub.downloaded() == set()
    monkeypatch.setenv("HF_TOKEN", hub.token)
    before = len(hub.requests)
    path = resolve_model("org/tiny", progress=False)
    assert (path / "model.safetensors").is_file()
    sent = [(m, p, h.get("authorization")) for m, p, h in hub.requests[before:]]
    assert sent and all(auth == f"Bearer {hub.token}" for _, _, auth in sent), sent


def test_private_repo_401_needs_a_token(hub, monkeypatch):
    hub.private.add("org/tiny")
    message = _one_line_error("org/tiny", "gated")
    assert "HTTP 401" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", hub.token)
    assert (resolve_model("org/tiny", progress=False) / "config.json").is_file()


def test_no_network_names_the_endpoint(hub, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    message = _one_line_error("org/tiny", "no-network")
    assert closed in message and "HF_HUB_OFFLINE=1" in message


def test_repo_without_weights_lists_its_files(hub):
    message = _one_line_error("org/readme-only", "no-weights")
    assert "README.md" in message and ":FILE.gguf" in message


def test_gguf_repo_without_a_named_file_suggests_one(hub):
    message = _one_line_error("org/tiny-GGUF", "no-weights")
    assert "org/tiny-GGUF:tiny.F32.gguf" in message


def test_named_gguf_file_missing_lists_the_gguf_files(hub):
    message = _one_line_error("org/tiny-GGUF:nope.gguf", "no-gguf-file")
    assert "'nope.gguf'" in message and "tiny.F32.gguf, tiny.Q8_0.gguf" in message
    assert hub.downloaded() == set()


def test_disk_full_says_where_and_how_much(hub, tmp_path, monkeypatch):
    import huggingface_hub._snapshot_download as snap

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snap, "hf_hub_download", full)
    message = _one_line_error("org/tiny", "disk-full")
    assert str(tmp_path / "hf-hub") in message and "MiB" in message


def test_dropped_connection_is_resumed_with_range(hub, tmp_path, monkeypatch):
    """huggingface_hub 2.x resumes a dropped transfer within the call (`Range: bytes=N-` into the
    same temporary file); a call that fails leaves no partial file, so the next starts over."""
    import huggingface_hub.constants as hf_constants
    import huggingface_hub.file_download as fd

    monkeypatch.setattr(fd.time, "sleep", lambda seconds: None)
    # chunks of 10 MB by default: the tiny file's first half would arrive as no whole chunk
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    data = hub.repos["org/tiny"].files["model.safetensors"]
    hub.drop.add("model.safetensors")
    path = resolve_model("org/tiny", progress=False)
    assert (path / "model.safetensors").read_bytes() == data
    ranges = [h.get("range") for m, p, h in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=")
    assert 0 < int(ranges[1][len("bytes="):-1]) <= len(data) // 2


def test_a_failed_transfer_is_one_line_and_the_next_call_completes(hub, tmp_path, monkeypatch):
    import huggingface_hub.file_download as fd

    monkeypatch.setattr(fd.time, "sleep", lambda seconds: None)
    hub.drop.add("model.safetensors")
    hub.drop_hold = True  # after the drop, the file answers 503
    message = _one_line_error("org/tiny", "http-error")
    assert "HTTP 503" in message
    blobs = tmp_path / "hf-hub" / "models--org--tiny" / "blobs"
    assert not [p for p in blobs.iterdir() if p.name.endswith(".incomplete")]
    hub.drop_hold = False
    path = resolve_model("org/tiny", progress=False)
    assert (path / "model.safetensors").read_bytes() == hub.repos["org/tiny"].files["model.safetensors"]


def test_cli_download_prints_the_directory(hub, tmp_path, capsys):
    assert main(["download", "org/tiny"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(str(tmp_path / "hf-hub" / "models--org--tiny" / "snapshots"))
    assert main(["download", "org/tiny-GGUF", "--gguf-file", "tiny.F32.gguf"]) == 0
    assert capsys.readouterr().out.strip().startswith(str(tmp_path / "ember-cache" / "gguf"))


def test_cli_errors_are_one_line_exit_1(hub, capsys):
    assert main(["download", "org/missing"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ember: error: cannot get 'org/missing' (revision main)") and err.count("\n") == 1
    assert main(["generate", "hi", "--model-id", "org/tiny", "--revision", "v9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ember: error: cannot get 'org/tiny' (revision v9)") and "Traceback" not in err


def test_the_suite_default_keeps_the_hub_off(tmp_path, monkeypatch):
    """conftest points HF_ENDPOINT at a closed local port for every other test: an unknown id
    never leaves the machine, and fails at once with the no-network line."""
    import os

    assert os.environ["HF_ENDPOINT"] == "http://127.0.0.1:9"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="cannot reach the Hub at http://127.0.0.1:9") as excinfo:
        resolve_model("nobody/no-such-model", progress=False)
    assert excinfo.value.reason == "no-network"


def test_local_paths_are_unchanged(hub, tiny_llama_dir, tmp_path):
    copy = tmp_path / "a:b.gguf-dir"
    shutil.copytree(tiny_llama_dir, copy)
    assert resolve_model(str(copy)) == copy
    assert hub.requests == []


def test_a_lora_adapter_comes_from_the_hub_with_only_its_two_files(tiny_llama_dir, tmp_path, monkeypatch):
    """A Hub id where a LoRA adapter's path goes (issue 32): only adapter_config.json and
    adapter_model.safetensors are fetched, into the HF cache; the adapter serves as the
    same directory does; a repository without an adapter is refused naming what it holds."""
    import huggingface_hub.constants as hf_constants

    from ember import EngineConfig
    from ember.engine.llm_engine import LLMEngine
    from ember.models.lora import LoRAKind
    from ember.plugin.adapter import AdapterError

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True,
                                    max_loras=2, max_lora_rank=8))
    local = tmp_path / "local-adapter"
    LoRAKind().write_example(local, dict(engine.adapters.targets), rank=4, seed=3)
    repos = {"org/tiny-lora": Repo.from_dir(local, {"README.md": b"# an adapter", "training_args.bin": b"junk"}),
             "org/readme-only": Repo({"README.md": b"# nothing here"})}
    with HubServer(repos) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        engine.add_adapter("hub", "org/tiny-lora")
        engine.add_adapter("local", str(local))
        with pytest.raises(AdapterError, match="'none'.*no adapter_config.json, adapter_model.safetensors"):
            engine.add_adapter("none", "org/readme-only")
        fetched = {path for method, path, _ in server.requests if method == "GET" and "/resolve/" in path}
    assert {p.rsplit("/", 1)[-1] for p in fetched} == {"adapter_config.json", "adapter_model.safetensors"}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for name in ("hub", "local", None):
        engine.add_request(None, params, prompt_token_ids=[5, 9, 14, 3], request_id=str(name), adapter=name)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert outs["hub"] == outs["local"] != outs["None"]
