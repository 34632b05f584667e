"""The CPU backend's two paths for a bf16 model (ember.hardware.cpu_paths): the choice
from the CPU's flags and the variable that forces one, the bf16 path's packed
weights and small-batch kernel, its bf16 native kernels, and a bf16-path model
against transformers in bf16. Whatever CPU runs this, both paths are exercised: the
bf16 one is forced where the CPU would not choose it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.hardware import cpu_kernels
from ember.hardware.cpu_linear import PackedLinear, pack_bf16, packing_works
from ember.hardware.cpu_paths import select_path
from tiny_models import make_tiny_model


@pytest.fixture
def kernels():
    loaded = cpu_kernels.load()
    if loaded is None:
        pytest.skip("native kernels unavailable on this machine (no AVX2/FMA or no C compiler)")
    return loaded


@pytest.mark.parametrize(
    "flags,forced,want",
    [
        ({"avx2", "amx_bf16", "avx512_bf16"}, "auto", "bf16"),
        ({"avx2", "avx512f", "avx512_bf16"}, "auto", "bf16"),
        ({"avx2", "fma"}, "auto", "fp32"),
        ({"avx2", "amx_bf16"}, "fp32", "fp32"),
        ({"avx2"}, "BF16", "bf16"),
        ({"avx2"}, "", "fp32"),
    ],
)
def test_the_path_follows_the_flags_unless_forced(flags, forced, want):
    path, why = select_path(flags, forced)
    assert path == want
    assert ("forced" in why) == (forced.lower() not in ("auto", ""))


def test_an_unknown_path_is_named():
    with pytest.raises(ValueError, match=r"path='avx9'.*auto, bf16, fp32"):
        select_path({"avx2"}, "avx9")


# oneDNN has no bf16 inner product on CPUs without AVX512-BF16/AMX (it refuses the
# primitive; ONEDNN_MAX_CPU_ISA=AVX2 shows it here): the bf16 path then keeps plain
# weights, which the model test below checks on every CPU
needs_packing = pytest.mark.skipif(
    not packing_works(), reason="oneDNN runs no bf16 inner product on this CPU (no AVX512-BF16/AMX)"
)


@needs_packing
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_the_bf16_product_and_routes_small_batches_to_the_kernel(kernels, with_bias):
    torch.manual_seed(0)
    weight = torch.randn(96, 64).bfloat16()
    tied = torch.randn(80, 64).bfloat16()  # read elsewhere too: packed as a copy
    bias = torch.randn(96).bfloat16() if with_bias else None
    base_calls = []

    def base(x, w, b=None):
        base_calls.append(tuple(x.shape))
        return F.linear(x, w, b)

    op = PackedLinear(base, kernels, max_rows=2)
    packed = op.pack(weight)
    op.add(tied)
    assert packed.is_mkldnn and op.plain_bytes == weight.numel() * 2
    gemv_rows = []
    real_gemv = kernels.gemv_bf16

    def spy(x, w, b=None):
        gemv_rows.append(x.shape[0])
        return real_gemv(x, w, b)

    kernels_spy = type("K", (), {"gemv_bf16": staticmethod(spy)})()
    op.kernels = kernels_spy
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, 64).bfloat16()
        want = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
        got = op(x, packed, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        # one bf16 rounding of a float32 accumulation
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(op(x, tied).float(), F.linear(x.float(), tied.float()), rtol=1e-2, atol=1e-2)
    assert gemv_rows == [1, 1, 2, 2]  # packed weight and tied copy, up to max_rows rows
    # what a product reads: the plain weight for few rows, the packed form beyond
    assert op.weight_read(packed, 2) is op._plain[id(packed)][1] and op.weight_read(packed, 3) is packed
    assert op.weight_read(tied, 1) is tied and op.weight_read(tied, 3) is op._packed[id(tied)][1]
    other = torch.randn(8, 64).bfloat16()  # neither packed nor registered: base
    op(torch.randn(3, 64).bfloat16(), other)
    assert base_calls == [(3, 64)]


@needs_packing
def test_packed_linear_without_kernels_keeps_no_plain_weights():
    op = PackedLinear(F.linear, None, max_rows=4)
    weight = torch.randn(16, 32).bfloat16()
    packed = op.pack(weight)
    assert op.plain_bytes == 0 and op.max_rows == 0
    x = torch.randn(1, 32).bfloat16()
    torch.testing.assert_close(op(x, packed).float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=1e-2)
    assert pack_bf16(weight).shape == weight.shape


# --- bf16 native kernels ----------------------------------------------------------------


def test_bf16_layer_ops_round_as_pytorchs_bf16_layers(kernels):
    from ember.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul

    torch.manual_seed(5)
    norm = RMSNorm(72, 1e-5, torch.bfloat16)
    norm.weight.data.normal_()
    x, res = torch.randn(6, 72).bfloat16(), torch.randn(6, 72).bfloat16()
    want, _ = norm(x, res)
    norm.fused = kernels.rms_norm
    got, got_sum = norm(x, res)
    assert got.dtype == torch.bfloat16 and torch.equal(got_sum, x + res)
    # the mean of squares is summed in another order: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
    assert (got != want).float().mean() < 0.05

    rope = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(4, (6 + 2 + 2) * 16).bfloat16()
    positions = torch.tensor([0, 3, 17, 63])
    q, k = qkv[:, : 6 * 16].view(4, 6, 16), qkv[:, 6 * 16 : 8 * 16].view(4, 2, 16)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    rope.fused = kernels.rope_
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # PyTorch's bf16 rounding exactly

    act = SiluAndMul()
    gate_up = (torch.randn(3, 2 * 44) * 4).bfloat16()  # 44: a vector part and a scalar tail
    want = act(gate_up)
    act.fused = kernels.silu_mul
    got = act(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)


def test_bf16_rounding_of_the_kernels_matches_torch_on_ties_and_specials(kernels):
    # a one-column product is exact in float32 (8-bit by 8-bit mantissas), so the
    # kernel's float32 -> bf16 rounding alone decides: ties to even, inf, NaN, overflow
    torch.manual_seed(4)
    x = torch.cat([torch.randn(500) * 3, torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38, 1.0625])])
    w = torch.cat([torch.randn(300), torch.tensor([1.0625, 2.0e38])])
    x, w = x.bfloat16()[:, None], w.bfloat16()[:, None]
    got = kernels.gemv_bf16(x, w)
    want = (x.float() @ w.float().T).bfloat16()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_gemv_with_bf16_activations_rounds_once(kernels):
    torch.manual_seed(2)
    x, w, b = torch.randn(3, 70).bfloat16(), torch.randn(33, 70).bfloat16(), torch.randn(33).bfloat16()
    got = kernels.gemv_bf16(x, w, b)
    want = (x.double() @ w.double().T + b.double()).bfloat16()
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() < 0.05  # float32 accumulation: rare one-step differences
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3)
    with pytest.raises(ValueError, match="bias must be torch.bfloat16"):
        kernels.gemv_bf16(x, w, b.float())


# --- a model on the bf16 path -----------------------------------------------------------


@pytest.mark.parametrize("kind,tied,packed", [("llama", True, True), ("qwen2", False, True), ("llama", False, False)])
def test_forced_bf16_path_model_matches_transformers_bf16(tmp_path, monkeypatch, caplog, kind, tied, packed):
    """Weights packed (the plain ones freed) where this torch's oneDNN runs bf16, else
    (or when packing is off) kept plain with a log line; the fused ops and the
    attention kernel in bf16; greedy tokens agree with transformers in bf16."""
    import logging

    import transformers
    from ember import LLM, SamplingParams
    from ember.hardware import cpu
    from ember.models.layers import FusableOp, Linear

    if not packed:  # as on a CPU where oneDNN has no bf16 inner product
        monkeypatch.setattr(cpu, "packing_works", lambda: False)
    make_tiny_model(kind, tmp_path / "m", seed=3, tie_word_embeddings=tied)
    with caplog.at_level(logging.INFO, logger="ember.hardware.cpu"):
        llm = LLM(model=str(tmp_path / "m"), dtype="bfloat16", num_kv_blocks=64, block_size=4,
                  backend_options={"path": "bf16"})
    model = llm.engine.model
    assert model.compute_dtype == torch.bfloat16
    assert "bf16 path for bf16 models (forced by the backend option path)" in caplog.text
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if packed and packing_works():
        assert linears and all(m.weight.is_mkldnn for m in linears)
        assert not any(n.endswith("proj.weight") for n, _ in model.named_parameters())  # plain copy freed
    else:
        assert linears and not any(m.weight.is_mkldnn for m in linears)
        assert "kept in plain layout" in caplog.text
    if cpu_kernels.load() is not None:
        assert all(m.fused is not None for m in model.modules() if isinstance(m, FusableOp))

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 12, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    hf.generation_config.eos_token_id = None
    matched = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = hf.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        matched += out.outputs[0].token_ids == want[0, len(prompt) :].tolist()
        # the first token comes from one prefill: both in bf16, same numbers to rounding
        assert out.outputs[0].token_ids[0] == want[0, len(prompt)].item()
    assert matched >= len(prompts) - 1, f"{matched}/{len(prompts)} greedy continuations equal transformers bf16"


# --- prefill attention after a cached context --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("flash", [True, False])
def test_a_chunk_after_its_context_attends_as_one_causal_product(monkeypatch, dtype, heads, kv_heads, flash):
    """The context part (seen whole) and the chunk part (causal) merged by their
    log-sum-exps equal one causal product over context + chunk, in float64."""
    from ember.hardware import cpu_attention

    if not flash:
        monkeypatch.setattr(cpu_attention, "_FLASH", None)  # a torch without the CPU flash op
    torch.manual_seed(heads + kv_heads)
    n_ctx, n_new, dim = 37, 11, 16
    q = torch.randn(1, heads, n_new, dim)
    k, v = torch.randn(1, kv_heads, n_ctx + n_new, dim), torch.randn(1, kv_heads, n_ctx + n_new, dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    got = cpu_attention._attend_after_context(q, k[:, :, :n_ctx], v[:, :, :n_ctx], k[:, :, n_ctx:], v[:, :, n_ctx:], 0.3,
                                              heads != kv_heads)
    mask = torch.ones(n_new, n_ctx + n_new, dtype=torch.bool).tril(diagonal=n_ctx)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                          enable_gqa=True)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the two parts and the merge each round once
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
