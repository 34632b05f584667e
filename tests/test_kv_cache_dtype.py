"""The KV cache's dtype (EngineConfig.kv_cache_dtype, --kv-cache-dtype): a 16-bit cache
beside float32 compute on the CPU (float16 by default for quantized weights), written
and read by the native kernels as PyTorch would round and widen it; and the CPU's
prompts-only step budget, which keeps a step's activations under glibc's mmap threshold."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.hardware import cpu_kernels
from ember.hardware.cpu import CPUBackend

kernels = cpu_kernels.load()
native = pytest.mark.skipif(kernels is None, reason="the native CPU kernels cannot be built here")


@native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_kv_write_rounds_float32_rows_as_pytorch_does(kv_dtype):
    torch.manual_seed(0)
    qkv = torch.randn(5, 3, 2, 16) * 30  # k and v as strided views of a fused projection
    k, v = qkv[:, 1], qkv[:, 2]
    k_cache, v_cache = torch.zeros(8, 2, 16, dtype=kv_dtype), torch.zeros(8, 2, 16, dtype=kv_dtype)
    slots = torch.tensor([7, 0, -1, 3, 5])
    kernels.kv_write(k, v, slots, k_cache, v_cache)
    rows = slots >= 0
    assert torch.equal(k_cache[slots[rows]], k[rows].to(kv_dtype))  # nearest even, as .to() rounds
    assert torch.equal(v_cache[slots[rows]], v[rows].to(kv_dtype))
    assert not k_cache[[1, 2, 4, 6]].any()
    with pytest.raises(ValueError, match="float32 into a 16-bit cache"):
        kernels.kv_write(k.to(kv_dtype), v.to(kv_dtype), slots, k_cache.float(), v_cache.float())


@native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_attention_over_a_16_bit_cache_is_attention_over_its_widened_values(kv_dtype):
    torch.manual_seed(1)
    q = torch.randn(4, 6, 32)
    k_cache, v_cache = torch.randn(16, 4, 2, 32).to(kv_dtype), torch.randn(16, 4, 2, 32).to(kv_dtype)
    tables = torch.randperm(16)[:12].view(4, 3)
    lens = torch.tensor([1, 5, 9, 12])
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    # widening is exact, so the kernel over the float32 copy does the same arithmetic
    want = kernels.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, 0.2)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(ValueError, match="a 16-bit one beside float32 q"):
        kernels.paged_decode_attention(q.bfloat16(), k_cache.half(), v_cache.half(), tables, lens, 0.2)


def test_the_cpu_backend_chooses_and_checks_the_kv_cache_dtype(monkeypatch):
    backend = CPUBackend()
    backend._path = "bf16"
    assert backend.kv_cache_dtype(torch.float32) == torch.float32  # a float model keeps its numbers
    assert backend.kv_cache_dtype(torch.float32, "auto", quantized=True) == (
        torch.float16 if kernels is not None else torch.float32)
    assert backend.kv_cache_dtype(torch.float32, "bfloat16") == torch.bfloat16
    assert backend.kv_cache_dtype(torch.bfloat16, "auto", quantized=True) == torch.bfloat16  # the bf16 path
    with pytest.raises(ValueError, match="computes in bfloat16 on the cpu backend, whose KV cache is then bfloat16"):
        backend.kv_cache_dtype(torch.bfloat16, "float16")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


@native
def test_a_float_model_runs_on_a_16_bit_cache_when_asked(tiny_llama_dir, caplog):
    prompts = [[(7 * i + j) % 250 + 3 for j in range(9 + 5 * i)] for i in range(3)]

    def run(kv_cache_dtype):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_tokens=512, kv_cache_dtype=kv_cache_dtype))
        assert engine.core.runner.kv_caches[0].dtype == getattr(torch, kv_cache_dtype)
        ids = [engine.add_request(None, SamplingParams(temperature=0, max_tokens=6, logprobs=1),
                                  prompt_token_ids=p) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        return [done[i] for i in ids]

    full = run("float32")
    for half in ("float16", "bfloat16"):
        for a, b in zip(run(half), full):
            # the tiny random model's logits move by the cache's rounding only
            lp_a = [e[t].logprob for t, e in zip(a.token_ids, a.logprobs)]
            lp_b = [e[t].logprob for t, e in zip(b.token_ids, b.logprobs)]
            assert a.token_ids[:3] == b.token_ids[:3]
            assert max(abs(x - y) for x, y in zip(lp_a[:3], lp_b[:3])) < 0.05


def test_prompt_steps_keep_the_widest_activation_under_the_mmap_threshold():
    backend = CPUBackend()
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536)
    assert backend.prefill_step_tokens(smollm2, torch.bfloat16) == 4096  # gate|up: 4096 x 3072 x 2 = 24 MiB
    assert backend.prefill_step_tokens(smollm2, torch.float32) == 2048  # 4096 rows would be 48 MiB
    assert backend.prefill_step_tokens(LlamaConfig(hidden_size=4096, intermediate_size=14336), torch.float32) == 1024
