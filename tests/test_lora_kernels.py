"""The CPU's native LoRA kernel (``BaseBackend.lora_op`` of the cpu backend) against the
products it stands for, and adapters inside CPU graphs: a quantized model's decode steps
with adapter tokens replay the captured graph and give the eager numbers bit for bit."""

import pytest
import torch

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.hardware import cpu_kernels
from ember.models.lora import LoRAKind

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernels cannot be built here")


def reference(y, x, a, bt, slots, rank, used):
    out = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            rows = slice(s * rank, s * rank + int(used[s]))
            out[t] += (x[t].float() @ a[rows].float().T) @ bt[rows].float()
    return out


@pytest.mark.parametrize("act, weights", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)])
def test_the_kernel_adds_each_tokens_own_slot_product(act, weights):
    gen = torch.Generator().manual_seed(0)
    T, K, N, rank, S = 7, 72, 200, 24, 3
    fused_x = torch.randn(T, K + 40, generator=gen).to(act)  # row-strided views, as of a fused projection
    fused_y = torch.randn(T, N + 24, generator=gen).to(act)
    x, y = fused_x[:, 8 : 8 + K], fused_y[:, :N]
    a = torch.randn(S * rank, K, generator=gen).to(weights)
    bt = torch.randn(S * rank, N, generator=gen).to(weights)
    used = torch.tensor([24, 8, 17])
    for s in range(S):  # rows past a slot's used ones are zero, as the engine keeps them
        a[s * rank + used[s] : (s + 1) * rank] = 0
        bt[s * rank + used[s] : (s + 1) * rank] = 0
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2])
    before = fused_y.clone()
    want = reference(y, x, a, bt, slots, rank, used)
    kernels.lora(y, x, a, bt, slots, rank, used)
    tol = dict(rtol=1e-5, atol=1e-4) if act == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y.float(), want, **tol)
    assert torch.equal(fused_y[[1, 5]], before[[1, 5]]), "base tokens are untouched, bit for bit"
    assert torch.equal(fused_y[:, N:], before[:, N:]), "columns outside the view are untouched"
    with pytest.raises(ValueError, match="slot is outside 0..2"):
        kernels.lora(y, x, a, bt, torch.tensor([3] * T), rank, used)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora(y, x, a, bt[:, :-1].contiguous(), slots, rank, used)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    from test_gguf_quant import _tiny_gguf

    from ember.weights import convert_gguf_to_hf

    tmp = tmp_path_factory.mktemp("lora-graphs")
    return convert_gguf_to_hf(_tiny_gguf(tmp, "Q4_0", arch="llama"), tmp / "q4", keep_quantized=True, progress=False)


def _engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_tokens=2048, block_size=16, seed=0, enable_lora=True,
                                  max_loras=3, max_lora_rank=8, **kwargs))


def _run(engine, prompts, adapters):
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(None, sampling, prompt_token_ids=p, adapter=a) for p, a in zip(prompts, adapters)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [(list(done[i].token_ids), [{t: lp.logprob for t, lp in e.items()} for e in done[i].logprobs])
            for i in ids]


def test_adapter_decodes_replay_the_graph_and_give_the_eager_numbers(q4_model, tmp_path):
    graphed = _engine(q4_model)
    eager = _engine(q4_model, enforce_eager=True)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert graphed.runner.adapter_slots.model.layers[next(iter(graphed.runner.adapter_slots.model.layers))].a.dtype \
        == torch.bfloat16, "auto: bfloat16 adapters beside a quantized base"
    targets = dict(graphed.adapters.targets)
    for i in range(3):
        LoRAKind().write_example(tmp_path / f"a{i}", targets, rank=4 + 2 * i, seed=i)
        for engine in (graphed, eager):
            engine.add_adapter(f"a{i}", str(tmp_path / f"a{i}"))
    replays = {"n": 0}
    run = graphed.runner.graphs.run

    def counting(*args):
        replays["n"] += 1
        return run(*args)

    graphed.runner.graphs.run = counting
    prompts = [[(11 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    adapters = ["a0", None, "a1", "a2", "a0", None]
    got = _run(graphed, prompts, adapters)
    assert replays["n"] > 5, "decode steps with adapter tokens replay the graph"
    assert got == _run(eager, prompts, adapters)  # tokens and logprobs, exactly
    base = _run(eager, prompts, [None] * 6)
    assert [g[0] for i, g in enumerate(got) if adapters[i]] != [b[0] for i, b in enumerate(base) if adapters[i]]
