"""CPU graphs (ember.hardware.cpu_graphs): decode steps recorded as their native kernel
calls and replayed by one C call give the eager forward's numbers bit for bit; the
capture refuses any forward that computes outside the recordable kernels; the arena
plan never lets two live buffers share memory; kernel errors inside a replay raise."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.hardware import cpu_graphs, cpu_kernels, cpu_quant
from ember.hardware.cpu_graphs import _Buffer, _pack, capture
from ember.plugin.backend import GraphCaptureRefused

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernels cannot be built here")


def _engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_tokens=2048, block_size=16, seed=0, **kwargs))


def _run(engine: LLMEngine) -> list[tuple[list[int], list[dict]]]:
    """Requests that join and finish at different steps (decode batches of 1 to 6 with
    prompts beside them, graph sizes replayed padded); tokens and top-2 logprobs."""
    prompts = [[(11 * i + j) % 250 + 3 for j in range(5 + 7 * i)] for i in range(6)]
    ids, done = [], {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2)
        ids.append(engine.add_request(None, params, prompt_token_ids=prompt))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [(list(done[i].token_ids), [{t: lp.logprob for t, lp in e.items()} for e in done[i].logprobs])
            for i in ids]


def _count_replays(engine: LLMEngine) -> dict[int, int]:
    graphs = engine.runner.graphs
    counts = dict.fromkeys(graphs.sizes, 0)
    for size, (replay, metadata) in list(graphs.graphs.items()):
        def counting(replay=replay, size=size):
            counts[size] += 1
            return replay()

        graphs.graphs[size] = (counting, metadata)
    return counts


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    """Tiny GGUF models converted quantized: Q4_0 (x8 layout), Q8_0 Qwen2 with q/k/v
    biases and a tied LM head (x8), Q5_1 (one-row kernels)."""
    from test_gguf_quant import _tiny_gguf

    from ember.weights import convert_gguf_to_hf

    tmp = tmp_path_factory.mktemp("cpu-graphs")
    return {
        (name, arch): convert_gguf_to_hf(_tiny_gguf(tmp, name, arch=arch, tie=tie), tmp / f"{name}-{arch}",
                                         keep_quantized=True, progress=False)
        for name, arch, tie in (("Q4_0", "llama", False), ("Q8_0", "qwen2", True), ("Q5_1", "llama", False))
    }


@pytest.mark.parametrize(("name", "arch"), [("Q4_0", "llama"), ("Q8_0", "qwen2"), ("Q5_1", "llama")])
def test_gguf_decode_graphs_give_the_eager_numbers_bit_for_bit(gguf_dirs, name, arch, caplog):
    with caplog.at_level(logging.INFO, logger="ember.worker.graphs"):
        graphed = _engine(gguf_dirs[name, arch])
    graphs = graphed.runner.graphs
    if name == "Q5_1":  # one-row kernels up to MAX_KERNEL_ROWS rows; more dequantize and GEMM in PyTorch
        assert graphs.sizes == (1, 2, 3, 4, 5, 6, 7, 8)
        assert "decode graphs of batch sizes 12,16,24,32 refused (they run eagerly)" in caplog.text
    else:
        assert graphs.sizes == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
    counts = _count_replays(graphed)
    got = _run(graphed)
    assert sum(counts.values()) > 10 and counts[1] and counts[4], counts
    eager = _engine(gguf_dirs[name, arch], enforce_eager=True)
    assert eager.runner.graphs is None
    assert got == _run(eager)  # tokens and logprobs, exactly


def test_bf16_decode_graphs_of_few_rows_give_the_eager_numbers(tiny_llama_dir):
    # bf16 weights: the native gemv serves few rows (PackedLinear on the bf16 path,
    # SmallBatchLinear on the fp32 path); larger batches run oneDNN and are refused
    graphed = _engine(tiny_llama_dir, dtype="bfloat16")
    assert graphed.runner.graphs is not None and graphed.runner.graphs.sizes[0] == 1
    counts = _count_replays(graphed)
    got = _run(graphed)
    assert counts[1], counts
    assert got == _run(_engine(tiny_llama_dir, dtype="bfloat16", enforce_eager=True))


def _graph_of_layer_ops(rows: int = 3, hidden: int = 64):
    """A small forward on the native layer ops: norm, silu_mul, norm with residual."""
    x = torch.randn(rows, hidden)
    w = torch.randn(hidden)
    gate_up = torch.randn(rows, 2 * hidden)

    def forward():
        h = kernels.rms_norm(x, None, w, 1e-6)
        act = kernels.silu_mul(gate_up)
        out, _ = kernels.rms_norm(act, h, w, 1e-6)
        return out

    return forward, (x, w, gate_up)


def test_a_replay_reads_its_inputs_anew_into_its_own_arena():
    forward, (x, w, gate_up) = _graph_of_layer_ops()
    graph = capture(forward)
    assert graph.names == ["ember_rms_norm", "ember_silu_mul", "ember_rms_norm"]
    # four buffers of 3 x 64 floats (the first norm's output, the activation, the
    # second norm's output and sum); h and act die at the last call, so the arena
    # holds them and the two outputs at once: nothing is freed before the last call
    assert graph.arena.numel() == 4 * 3 * 64 * 4
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        gate_up.copy_(torch.randn_like(gate_up))
        want = forward()
        got = graph()
        assert got.data_ptr() != want.data_ptr() and torch.equal(got, want)


def test_the_plan_never_overlaps_live_buffers_and_reuses_dead_ones():
    rng = np.random.default_rng(0)
    for _ in range(50):
        buffers = []
        for i in range(30):
            first = int(rng.integers(0, 40))
            buffers.append(_Buffer(base=1000 * i, nbytes=int(rng.integers(1, 500)), first_call=first,
                                   last_call=first + int(rng.integers(0, 10))))
        size = _pack(buffers)
        for a in buffers:
            assert a.offset % cpu_graphs.ALIGNMENT == 0 and a.offset + a.nbytes <= size
            for b in buffers:
                live_together = a is not b and a.first_call <= b.last_call and b.first_call <= a.last_call
                if live_together:
                    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
        assert size < sum(-(-b.nbytes // 64) * 64 for b in buffers)  # dead buffers' memory was reused


def test_a_chain_of_buffers_alive_two_calls_each_fits_in_two_places():
    buffers = [_Buffer(base=i, nbytes=100, first_call=i, last_call=i + 1) for i in range(20)]
    assert _pack(buffers) == 2 * 128


def test_the_capture_refuses_work_outside_the_native_kernels():
    forward, (x, w, gate_up) = _graph_of_layer_ops()
    with pytest.raises(GraphCaptureRefused, match=r"computes aten\.add\.Tensor outside the native kernels"):
        capture(lambda: forward() + 1)
    with pytest.raises(GraphCaptureRefused, match=r"computes aten\.clone\.default"):
        capture(lambda: forward().t().contiguous())
    with pytest.raises(GraphCaptureRefused, match=r"aten\.index_copy_\.default \(it writes a tensor\)"):
        capture(lambda: x.index_copy_(0, torch.tensor([0]), forward()[:1]))
    with pytest.raises(GraphCaptureRefused, match="ember_greedy, which a CPU graph cannot record"):
        capture(lambda: kernels.greedy(forward())[1])
    with pytest.raises(GraphCaptureRefused, match="the forward's output was not written by a recorded call"):
        capture(lambda: x[:2])
    # a refused capture leaves nothing behind: later native calls are not recorded
    assert capture(forward).num_calls == 3


@pytest.mark.parametrize("name", ["Q8_0", "Q5_1"])  # the x8 kernel; the one-row kernel
def test_quantized_products_are_recorded_and_replayed(name):
    quant = cpu_quant.load()
    if quant is None:
        pytest.skip("the native GGUF kernels cannot be built here")
    from test_gguf_quant import random_blocks

    data = torch.from_numpy(random_blocks(name, 16, 64))
    x8 = quant.x8_layout(name, 16)
    packed = quant.repack_x8(data, name, 64) if x8 else data
    x = torch.randn(2, 64)
    w = torch.ones(64)

    def forward():
        h = kernels.rms_norm(x, None, w, 1e-6)
        return quant.linear_x8(h, packed, name) if x8 else quant.linear(h, data, name)

    graph = capture(forward)
    assert graph.names == ["ember_rms_norm", "ember_quant_linear_x8" if x8 else "ember_quant_linear_f32"]
    x.copy_(torch.randn_like(x))
    assert torch.equal(graph(), forward())


def test_a_kernel_error_inside_a_replay_raises_naming_the_kernel():
    ids = torch.tensor([1, 2])
    table = torch.randn(10, 8)
    graph = capture(lambda: kernels.embedding(ids, table))
    assert torch.equal(graph(), table[[1, 2]])
    ids[1] = 10  # outside the vocabulary
    with pytest.raises(RuntimeError, match=r"CPU graph: ember_embedding \(call 0 of 1\) failed with code -1"):
        graph()
    with pytest.raises(IndexError, match=r"outside the vocabulary \[0, 10\)"):
        kernels.embedding(ids, table)


def test_kv_write_skips_padding_and_refuses_slots_past_the_cache():
    qkv = torch.randn(3, 3, 2, 8)  # (tokens, q|k|v, heads, D): k and v as strided views
    k, v = qkv[:, 1], qkv[:, 2]
    k_cache, v_cache = torch.zeros(6, 2, 8), torch.zeros(6, 2, 8)
    kernels.kv_write(k, v, torch.tensor([4, -1, 0]), k_cache, v_cache)
    assert torch.equal(k_cache[4], k[0]) and torch.equal(v_cache[0], v[2])
    assert not k_cache[[1, 2, 3, 5]].any() and not v_cache[[1, 2, 3, 5]].any()  # the -1 row wrote nothing
    with pytest.raises(ValueError, match="a slot lies past the cache's 6 slots"):
        kernels.kv_write(k, v, torch.tensor([1, 6, 2]), k_cache, v_cache)
    assert not k_cache[1].any()  # nothing written before the refusal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_queries_from_a_fused_projection(dtype):
    torch.manual_seed(0)
    qkv = torch.randn(5, 4 * 8 + 2 * 2 * 8).to(dtype)  # 5 decodes, 4 heads, 2 KV heads, D 8
    q = qkv[:, :32].view(5, 4, 8)
    k_cache = torch.randn(8, 4, 2, 8).to(dtype)
    v_cache = torch.randn(8, 4, 2, 8).to(dtype)
    tables = torch.tensor([[i % 8, (i + 3) % 8] for i in range(5)])
    lens = torch.tensor([1, 4, 5, 7, 8])
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3)
    assert torch.equal(got, kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, 0.3))


def test_a_capture_does_not_import_torch_compile():
    # a TorchDispatchMode would import torch._dynamo (and Triton) at its first op:
    # seconds at engine start-up, and Triton's leak reports on a server's stderr
    code = """
import sys, torch
from ember.hardware import cpu_graphs, cpu_kernels
x, w = torch.randn(2, 64), torch.ones(64)
with torch.inference_mode():
    graph = cpu_graphs.capture(lambda: cpu_kernels.load().rms_norm(x, None, w, 1e-6))
assert torch.equal(graph(), cpu_kernels.load().rms_norm(x, None, w, 1e-6))
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
