"""The KV memory budget: the pool is sized from an explicit budget or the backend's
share of free memory, reported in tokens, and never grows: a workload that needs more
than the pool preempts instead of allocating."""

import httpx
import pytest
from server_utils import running_server

from ember import LLM, SamplingParams
from ember.hardware.cpu import CPUBackend, available_memory_bytes


def kv_bytes(llm) -> int:
    return sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)


def test_an_explicit_budget_sizes_the_pool_and_it_never_grows(tiny_llama_dir):
    budget = 300_000
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4, kv_cache_memory_bytes=budget)
    engine = llm.engine
    per_token = engine.model.kv_cache_spec.bytes_per_token(engine.kv_dtype)
    assert per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    num_blocks = budget // (per_token * 4)
    assert engine.kv_manager.num_blocks == num_blocks
    assert engine.num_kv_cache_tokens == num_blocks * 4
    assert kv_bytes(llm) == num_blocks * 4 * per_token <= budget
    pointers = [t.data_ptr() for t in engine.runner.kv_caches]

    # 12 requests of 60 tokens each need 180 blocks at once: more than the pool
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[[5 + i] * 20 for i in range(12)], sampling_params=params)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert engine.scheduler.num_preemptions > 0
    assert [t.data_ptr() for t in engine.runner.kv_caches] == pointers
    assert kv_bytes(llm) == num_blocks * 4 * per_token
    assert engine.kv_manager.num_free_blocks == num_blocks


def test_a_budget_below_one_block_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="holds less than one block"):
        LLM(model=str(tiny_llama_dir), dtype="float32", block_size=16, kv_cache_memory_bytes=1000)


def test_the_cpu_default_is_a_quarter_of_available_memory_capped():
    budget = CPUBackend().kv_cache_memory_bytes(100 << 20)
    assert budget == max(256 << 20, min(2 << 30, available_memory_bytes() // 4))
    assert 0 < available_memory_bytes()


def test_the_server_reports_capacity_in_tokens(tiny_llama_dir):
    with running_server(tiny_llama_dir, engine={"num_kv_blocks": None, "kv_cache_memory_bytes": 2 << 20}) as srv:
        info = httpx.get(f"{srv.url}/info").json()
    per_token = 2 * 2 * 2 * 16 * 4
    assert info["num_kv_blocks"] == (2 << 20) // (per_token * 8)
    assert info["kv_cache_tokens"] == info["num_kv_blocks"] * 8 == info["max_batch_total_tokens"]
    assert info["num_preemptions"] == 0


def test_serve_settings_pass_the_budget_and_batch_size_to_the_engine():
    from ember.api.settings import ServerSettings, engine_config_kwargs

    kwargs = engine_config_kwargs(ServerSettings(kv_cache_memory=64 << 20, max_batch_size=8))
    assert kwargs["kv_cache_memory_bytes"] == 64 << 20 and kwargs["max_num_seqs"] == 8
    assert "num_kv_blocks" not in kwargs and "num_kv_tokens" not in kwargs
    # TGI's --max-batch-total-tokens is a number of tokens, whatever the attention's block size
    assert engine_config_kwargs(ServerSettings(max_batch_total_tokens=1000))["num_kv_tokens"] == 1000


# -- a budget smaller than one request: said in the user's own terms, before loading when it can be

PER_TOKEN = 2 * 2 * 2 * 16 * 4  # the tiny Llama's KV bytes per token in float32: 512
CONTEXT = "--max-total-tokens 256 (the model's context, the default)"


@pytest.mark.parametrize(
    "argv, message, is_before_loading",
    [
        (["--kv-cache-memory", "64KiB"],
         f"the KV cache budget (--kv-cache-memory 64KiB) holds 128 tokens, less than one request of {CONTEXT}; "
         "lower --max-total-tokens to at most 128 or raise --kv-cache-memory to at least 128KiB", True),
        (["--kv-cache-memory", "65536", "--max-total-tokens", "200"],
         "the KV cache budget (--kv-cache-memory 64KiB) holds 128 tokens, less than one request of "
         "--max-total-tokens 200; lower --max-total-tokens to at most 128 or raise --kv-cache-memory to at least 104KiB",
         True),
        (["--max-batch-total-tokens", "100"],
         f"--max-batch-total-tokens 100 is less than one request of {CONTEXT}; lower --max-total-tokens to "
         "at most 100 or raise --max-batch-total-tokens to at least 256", True),
        # 250 tokens are 16 blocks of 16, which hold 256: only the limit itself is short
        (["--max-batch-total-tokens", "250"],
         f"--max-batch-total-tokens 250 is less than one request of {CONTEXT}; lower --max-total-tokens to "
         "at most 250 or raise --max-batch-total-tokens to at least 256", False),
    ],
)
def test_a_kv_cache_smaller_than_one_request_names_what_the_user_set(
    tiny_llama_dir, monkeypatch, capsys, argv, message, is_before_loading
):
    import ember.api.server
    import ember.engine.core
    from ember.api.cli import main

    if is_before_loading:
        monkeypatch.setattr(ember.engine.core, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    monkeypatch.setattr(ember.api.server, "create_server", lambda *a, **k: pytest.fail("the server started"))
    # the core in this process, where the patches apply
    assert main(["serve", "--model-id", str(tiny_llama_dir), "--dtype", "float32", "--engine-mode", "thread", *argv]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"ember: error: {message}"
    # the default, the core in its own process, says the same
    assert main(["serve", "--model-id", str(tiny_llama_dir), "--dtype", "float32", *argv]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"ember: error: {message}"


def test_the_default_budget_smaller_than_one_request_says_what_to_set(tiny_llama_dir, monkeypatch, capsys):
    import ember.api.server
    from ember.api.cli import main

    monkeypatch.setattr(CPUBackend, "kv_cache_memory_bytes", lambda self, model_bytes, activation_bytes=0: 64 << 10)
    monkeypatch.setattr(ember.api.server, "create_server", lambda *a, **k: pytest.fail("the server started"))
    assert main(["serve", "--model-id", str(tiny_llama_dir), "--dtype", "float32", "--engine-mode", "thread"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ember: error: the KV cache (64KiB, the backend's default share of memory) holds 128 tokens, less than "
        f"one request of {CONTEXT}; lower --max-total-tokens to at most 128 or give --kv-cache-memory of at "
        "least 128KiB"
    )


def test_derived_limits_are_named_as_derived():
    from ember.api.settings import ServerSettings, resolve_limits

    with pytest.raises(ValueError) as caught:
        resolve_limits(ServerSettings(max_input_tokens=300), max_model_len=256, num_kv_tokens=10_000)
    assert str(caught.value) == (
        "--max-input-tokens (300) must be < --max-total-tokens (256, the model's context, the default): "
        "a request needs room for at least one generated token"
    )


def test_the_engine_refuses_a_kv_cache_below_max_model_len_only_when_asked(tiny_llama_dir, monkeypatch):
    import ember.engine.core
    from ember.worker.kv_sizing import KVCacheTooSmallError

    with monkeypatch.context() as patch:
        patch.setattr(ember.engine.core, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
        with pytest.raises(KVCacheTooSmallError) as caught:
            LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=64 << 10,
                require_kv_for_max_model_len=True)
    error = caught.value
    assert (error.num_kv_tokens, error.max_model_len, error.bytes_per_token, error.budget_bytes) == (128, 256, 512, 64 << 10)
    assert str(error) == (
        "the KV cache holds 128 tokens, less than one request of max_model_len 256; lower max_model_len to at "
        "most 128 or raise kv_cache_memory_bytes to at least 131072"
    )
    # offline, a smaller cache is allowed: it only refuses the requests that do not fit
    assert LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=64 << 10).engine.num_kv_cache_tokens == 128
