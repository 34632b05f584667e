"""Tensor and pipeline parallelism (ember.parallel) over gloo on CPU, fp32.

Every parallel run is compared with the same engine in one process (TP=1), whose
equality with Hugging Face transformers tests/test_exactness.py establishes: the
same greedy tokens, and log-probabilities (the sampled token's and its top 20,
so logits up to their per-row constant) within 1e-4, with prefix caching, chunked
prefill (16-token steps) and preemption (a KV pool of 96 tokens for six requests
of about 50) all in play. Each run spawns real worker processes; one engine is
started per configuration and shared by the tests that read it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ember.engine.llm import LLM
from ember.plugin import create_plugin_manager
from ember.sampling_params import SamplingParams
from ember.testing.tiny_models import make_tiny_model

PREFIX = "The story so far: a fox, a dog and a"
PROMPTS = [PREFIX + " cat.", PREFIX + " bird!", "hello world", PREFIX + " cow", "zz top", PREFIX + "..."]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20)
# prefix caching on, chunked prefill in 16-token steps, a pool small enough to preempt
ENGINE = {
    "dtype": "float32", "block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 6,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "seed": 0,
}
TOLERANCE = 1e-4


def _generate(model_dir, prompts=PROMPTS, params=PARAMS, plugin_manager=None, **parallel):
    """(outputs, engine counts, per-rank descriptions or None) of one engine's run."""
    with LLM(str(model_dir), plugin_manager=plugin_manager, **ENGINE, **parallel) as llm:
        outs = llm.generate(prompts, params)
        core = llm.engine.core
        counts = (core.scheduler.num_preemptions, core.kv_manager.num_prefix_hits)
        ranks = core.parallel.describe_ranks() if core.parallel is not None else None
        weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    return outs, counts, ranks, weight_bytes


def _assert_same(reference, parallel) -> None:
    ref_outs, ref_counts = reference[0], reference[1]
    outs, counts = parallel[0], parallel[1]
    assert ref_counts[0] > 0 and ref_counts[1] > 0, f"no preemption or prefix hit in the reference run: {ref_counts}"
    assert counts == ref_counts  # the same scheduler decisions
    worst = 0.0
    for ref, out in zip(ref_outs, outs):
        a, b = ref.outputs[0], out.outputs[0]
        assert b.token_ids == a.token_ids
        for lp_a, lp_b in zip(a.token_logprobs, b.token_logprobs):
            worst = max(worst, abs(lp_a - lp_b))
        for top_a, top_b in zip(a.logprobs, b.logprobs):
            common = top_a.keys() & top_b.keys()
            assert len(common) >= 19  # the same top tokens (the 20th may trade places on a near-tie)
            worst = max(worst, *(abs(top_a[t].logprob - top_b[t].logprob) for t in common))
    assert worst < TOLERANCE, f"log-probabilities differ by {worst:.2e}"


def _tiny(tmp_path_factory, name: str, kind: str, **overrides) -> Path:
    path = tmp_path_factory.mktemp(name)
    make_tiny_model(kind, path, seed=1, **overrides)
    return path


@pytest.fixture(scope="module")
def llama_kv1(tmp_path_factory):
    # one KV head for two ranks: each rank keeps a copy of it
    return _tiny(tmp_path_factory, "llama_kv1", "llama", num_attention_heads=4, num_key_value_heads=1)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return _tiny(tmp_path_factory, "mistral", "mistral", num_hidden_layers=3)


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory):
    # biases on q/k/v and an LM head tied to the vocabulary-parallel embedding
    return _tiny(tmp_path_factory, "qwen2", "qwen2", tie_word_embeddings=True, num_key_value_heads=1)


@pytest.fixture(scope="module")
def legacy_llama(tmp_path_factory):
    """A checkpoint only the example plugin (ember-legacy-llama) can load: its
    config.json names the old ``LLaMAForCausalLM`` architecture."""
    path = _tiny(tmp_path_factory, "legacy", "llama", num_key_value_heads=2)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LLaMAForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tp2_llama(llama_kv1):
    return _generate(llama_kv1), _generate(llama_kv1, tensor_parallel_size=2)


def test_tp2_llama_with_fewer_kv_heads_than_ranks_equals_one_process(tp2_llama):
    reference, parallel = tp2_llama
    _assert_same(reference, parallel)
    ranks = parallel[2]
    assert [(r.rank, r.tp_rank, r.num_heads, r.num_kv_heads) for r in ranks] == [(0, 0, 2, 1), (1, 1, 2, 1)]


def test_tp2_each_rank_holds_about_half_the_weights(tp2_llama):
    (_, _, _, total), (_, _, ranks, driver_bytes) = tp2_llama
    assert ranks[0].weight_bytes == driver_bytes
    for rank in ranks:
        # the one KV head and the norms are replicated: a little over half (52%)
        assert 0.45 * total <= rank.weight_bytes <= 0.55 * total, (rank.weight_bytes, total)
    assert sum(r.weight_bytes for r in ranks) >= total


def test_tp2_qwen2_tied_embeddings_equals_one_process(qwen2_tied):
    _assert_same(_generate(qwen2_tied), _generate(qwen2_tied, tensor_parallel_size=2))


def test_pp2_mistral_equals_one_process(mistral):
    reference = _generate(mistral)
    parallel = _generate(mistral, pipeline_parallel_size=2)
    _assert_same(reference, parallel)
    # three layers over two stages: the first takes two
    assert [(r.pp_rank, r.layer_range) for r in parallel[2]] == [(0, (0, 2)), (1, (2, 3))]


def test_tp2_pp2_qwen2_four_processes_equals_one_process(qwen2_tied):
    reference = _generate(qwen2_tied)
    parallel = _generate(qwen2_tied, tensor_parallel_size=2, pipeline_parallel_size=2)
    _assert_same(reference, parallel)
    assert [(r.tp_rank, r.pp_rank) for r in parallel[2]] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("model, parallel", [
    ("llama_kv1", {"pipeline_parallel_size": 2}),
    ("llama_kv1", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    ("mistral", {"tensor_parallel_size": 2}),
    ("mistral", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    ("qwen2_tied", {"pipeline_parallel_size": 2}),  # the tied embedding on stage 0, its LM head on stage 1
], ids=["llama-pp2", "llama-tp2pp2", "mistral-tp2", "mistral-tp2pp2", "qwen2-pp2"])
def test_the_other_layouts_of_each_architecture_equal_one_process(request, model, parallel):
    """With the tests above, each tiny architecture runs TP=2, PP=2 and TP=2 x PP=2."""
    model_dir = request.getfixturevalue(model)
    _assert_same(_generate(model_dir), _generate(model_dir, **parallel))


def test_plugins_reach_every_worker_entry_points_and_programmatic(legacy_llama):
    """The architecture and the ban_digits processor of the example plugin, registered
    programmatically in the driver (its entry point disabled), are registered by module
    name in each worker: the workers could not build the model otherwise."""
    import ember_legacy_llama.plugin as legacy

    def plugin_manager():
        return create_plugin_manager(disabled=("legacy_llama",), extra_plugins=[("legacy_direct", legacy)])

    params = [PARAMS] * 3 + [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20,
                                            extra={"ban_digits": True})] * 3
    prompts = ["1 2 3 4", "numbers: 5", "hi 9"] * 2
    disabled = ("legacy_llama",)  # the workers must not find it through its entry point either
    reference = _generate(legacy_llama, prompts, params, plugin_manager(), disabled_plugins=disabled)
    parallel = _generate(legacy_llama, prompts, params, plugin_manager(), tensor_parallel_size=2,
                         disabled_plugins=disabled)
    for ref, out in zip(reference[0], parallel[0]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert all(not any(c.isdigit() for c in out.outputs[0].text) for out in parallel[0][3:])
    for rank in parallel[2]:
        assert "legacy_direct" in rank.plugins and "legacy_llama" not in rank.plugins


def test_bad_parallel_settings_are_refused_with_their_values(llama_kv1, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(str(llama_kv1), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split the model's 4 attention heads"):
        LLM(str(llama_kv1), dtype="float32", num_kv_blocks=8, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than the model's 2 layers"):
        LLM(str(llama_kv1), dtype="float32", num_kv_blocks=8, pipeline_parallel_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
], ids=["tp2", "pp2", "tp2pp2"])
def test_smollm2_tp2_equals_one_process(monkeypatch, parallel):
    """The default model (a Q4_1 GGUF, converted once to a safetensors directory in
    Ember's cache, which each rank slices), fp32, TP=2, PP=2 and both. The sharded run leaves
    EMBER_GGUF_NATIVE unset, as a user's ``ember serve --tensor-parallel-size 2`` does:
    a sharded engine loads the GGUF's float32 conversion (quantized weights are not
    sharded), never refuses the default model."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=20)
    settings = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 16, "max_num_batched_tokens": 16, "seed": 0}
    with LLM(None, **settings) as llm:
        reference = llm.generate(prompts, params)
        total = sum(p.numel() * p.element_size() for p in llm.engine.core.model.parameters())
    monkeypatch.delenv("EMBER_GGUF_NATIVE", raising=False)
    with LLM(None, **parallel, **settings) as llm:
        assert getattr(llm.engine.core.hf_config, "quantization_config", None) is None
        outs = llm.generate(prompts, params)
        ranks = llm.engine.core.parallel.describe_ranks()
    worst = 0.0
    for ref, out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        worst = max([worst] + [abs(a - b) for a, b in zip(ref.outputs[0].token_logprobs, out.outputs[0].token_logprobs)])
    assert worst < TOLERANCE
    if parallel != {"tensor_parallel_size": 2}:
        return
    # SmolLM2's 9 heads in 3 KV groups: rank 0 computes 2 groups, rank 1 one; with
    # the MLP and the vocabulary split evenly, each rank holds about half (53% / 47%)
    assert [(r.num_heads, r.num_kv_heads) for r in ranks] == [(6, 2), (3, 1)]
    for rank in ranks:
        assert 0.44 * total <= rank.weight_bytes <= 0.56 * total, (rank.weight_bytes, total)


# -- ember serve --tensor-parallel-size 2 ------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            stack.extend(kids)
    return found


def _worker_pids(server_pid: int) -> list[int]:
    pids = []
    for pid in _children(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline:
            pids.append(pid)
    return pids


def _wait_until_ready(process: subprocess.Popen, url: str, timeout: float = 120) -> None:
    """Until ``url``/health answers 200; fails with the process's output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not become ready in {timeout:.0f} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_serve_tp2_answers_openai_and_tgi_and_stops_when_a_worker_dies(llama_kv1):
    import openai

    port = _free_port()
    graceful = 10
    command = [
        sys.executable, "-m", "ember.api.cli", "serve", "--model-id", str(llama_kv1), "--dtype", "float32",
        "--port", str(port), "--tensor-parallel-size", "2", "--max-batch-total-tokens", "2048",
        "--graceful-termination-timeout", str(graceful), "--engine-mode", "thread",
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(server, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 8 or chat.choices[0].finish_reason
        completion = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0)
        with LLM(str(llama_kv1), dtype="float32", num_kv_blocks=64) as llm:  # the same text in one process
            expected = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
        assert completion.choices[0].text == expected
        tgi = httpx.post(f"{url}/generate", json={"inputs": "hello world",
                                                  "parameters": {"max_new_tokens": 6}}, timeout=30)
        assert tgi.status_code == 200 and tgi.json()["generated_text"] == expected

        workers = _worker_pids(server.pid)
        assert len(workers) == 1, workers
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True,
        }) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    os.kill(workers[0], signal.SIGKILL)
        assert len(events) < 400
        last = json.loads(events[-1]) if events[-1] != "[DONE]" else json.loads(events[-2])
        assert "error" in last and "worker" in last["error"]["message"], events[-3:]
        try:  # while it drains, a new request is refused
            refused = httpx.post(f"{url}/generate", json={"inputs": "hi"}, timeout=5)
            assert refused.status_code == 503
        except httpx.TransportError:
            pass  # already gone
        code = server.wait(timeout=graceful + 15)
        assert code != 0
        output = server.stdout.read()
        assert "worker rank 1" in output or "parallel step failed" in output, output[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


@pytest.mark.slow
def test_the_documented_torchrun_command_serves_with_two_ranks(llama_kv1):
    """docs/parallel.md's one-machine torchrun line (the multi-machine one differs only in
    --nnodes/--node-rank/--master-addr): torchrun starts two ranks, rank 0 serves HTTP,
    rank 1 computes, and the text equals one process's. Stopping rank 0 stops the job."""
    port = _free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ember.api.cli", "serve", "--model-id", str(llama_kv1), "--dtype", "float32",
        "--tensor-parallel-size", "2", "--port", str(port), "--max-batch-total-tokens", "2048",
    ]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(job, url)
        tgi = httpx.post(f"{url}/generate", json={"inputs": "hello world", "parameters": {"max_new_tokens": 6}},
                         timeout=30)
        with LLM(str(llama_kv1), dtype="float32", num_kv_blocks=64) as llm:
            expected = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
        assert tgi.status_code == 200 and tgi.json()["generated_text"] == expected, tgi.text
        os.killpg(job.pid, signal.SIGTERM)  # what a terminal's Ctrl-C or a pod's stop sends the job
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
