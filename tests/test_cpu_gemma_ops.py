"""The CPU backend's fused ops for Gemma and Qwen3 (GeGLU, per-head q/k norms in place,
the embedding's scale) against the PyTorch layers they replace, in float32 and bf16;
and a Gemma model's decode steps captured as CPU graphs with the same tokens."""

import pytest
import torch

from ember.models.layers import GeluAndMul, HeadRMSNorm, Scale


@pytest.fixture
def kernels(native_kernels):
    if native_kernels is None:
        pytest.fail("the native CPU kernels did not build")
    return native_kernels


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_gelu_tanh_mul_matches_pytorch(kernels, dtype, tol):
    act = GeluAndMul()
    gate_up = (torch.randn(5, 2 * 44, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    plain = act(gate_up)
    act.fused = kernels.gelu_tanh_mul
    torch.testing.assert_close(act(gate_up), plain, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_head_rms_norm_in_place_on_a_fused_projection(kernels, dtype, tol):
    torch.manual_seed(1)
    norm = HeadRMSNorm(16, 1e-6, dtype)
    norm.weight.data.normal_()
    qkv = torch.randn(3, (4 + 2 + 2) * 16).to(dtype)
    q = qkv[:, : 4 * 16].view(3, 4, 16)  # rows (4 + 2 + 2) * 16 apart
    want = norm(q.clone())
    v_before = qkv[:, 6 * 16 :].clone()
    norm.fused = kernels.head_rms_norm_
    got = norm(q)
    assert got.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, 6 * 16 :], v_before)  # k and v untouched
    with pytest.raises(ValueError, match="heads and dims must be contiguous"):
        kernels.head_rms_norm_(qkv.view(3, 8, 16).transpose(0, 1), norm.weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_rounds_as_a_product_in_the_dtype(kernels, dtype):
    scale = Scale(640 ** 0.5)
    x = torch.randn(4, 640).to(dtype)
    want = x * torch.tensor(640 ** 0.5, dtype=dtype)  # transformers' Gemma embedding scale
    scale.fused = kernels.scale_
    got = scale(x.clone())
    assert torch.equal(got, want)


def test_a_gemma_decode_is_captured_as_cpu_graphs_with_the_same_tokens(tmp_path, caplog):
    """A tiny Gemma 3 in Q8_0 kept quantized (the native path of the real 270M model):
    every op of its decode step is a native kernel, so CPU graphs capture it."""
    import logging

    from test_gguf_archs import Q8_0, tiny, write_gguf

    from ember import LLM, SamplingParams
    from ember.weights import convert_gguf_to_hf

    src = write_gguf(tmp_path / "g.gguf", tiny("gemma3"), "gemma3", Q8_0)
    model = convert_gguf_to_hf(src, tmp_path / "native", progress=False, keep_quantized=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 9, 40, 41, 42, 3, 7, 8, 100], [17, 18]]
    with caplog.at_level(logging.INFO, logger="ember.worker.graphs"):
        graphs = LLM(str(model), num_kv_blocks=64, block_size=4)
    assert graphs.engine.runner.graphs is not None, caplog.text
    assert {1, 2} <= set(graphs.engine.runner.graphs.sizes), caplog.text
    eager = LLM(str(model), num_kv_blocks=64, block_size=4, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in graphs.generate(prompt_token_ids=prompts, sampling_params=params)] \
        == [o.outputs[0].token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_one_row_through_segments_of_two_types_writes_one_output_row():
    """A fused linear whose parts have different GGUF types (Gemma 3 270M's qkv: Q5_0 q
    and k, Q8_0 v): one row runs each segment's kernel into its columns of one output
    (no torch.cat, which a CPU graph cannot record), with the numbers of the general path."""
    import gguf
    import numpy as np

    from ember.hardware.cpu_gguf import GGUFLinearOp
    from ember.plugins.quantizers.gguf import GGUFWeight

    rng = np.random.default_rng(0)
    segments = []
    for name, rows in (("Q5_0", 64), ("Q8_0", 32)):
        data = gguf.quants.quantize((rng.standard_normal((rows, 64)) * 0.1).astype(np.float32),
                                    getattr(gguf.GGMLQuantizationType, name))
        segments.append((name, torch.from_numpy(np.ascontiguousarray(data))))
    from ember.hardware.cpu_options import CPUOptions

    op = GGUFLinearOp(CPUOptions(gguf_q5_0_x8=False))  # Q5_0 as read: two segments, two kernels
    weight = op.prepare(GGUFWeight(segments, 64))
    assert len(weight.kernel_plan) == 2
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    both = op(x, weight)  # two rows: the segments' outputs joined
    one = op(x[:1], weight)
    assert one.shape == (1, 96) and torch.equal(one[0], both[0])
    reference = torch.nn.functional.linear(x[:1], weight.dequantize(torch.float32))
    torch.testing.assert_close(one, reference, rtol=0, atol=2e-2)

    # by default Q5_0 is re-encoded as Q8_0 (lossless) and joins the Q8_0 rows: one x8 segment
    joined = GGUFLinearOp().prepare(GGUFWeight(segments, 64))
    assert [(p[0], p[2], p[5]) for p in joined.kernel_plan] == [(8, 96, True)]  # ggml type 8: Q8_0
    assert torch.equal(joined.dequantize(torch.float32), weight.dequantize(torch.float32))
    torch.testing.assert_close(GGUFLinearOp()(x[:1], joined), reference, rtol=0, atol=2e-2)


def test_q5_0_re_encoded_as_q8_0_holds_the_same_values():
    import gguf
    import numpy as np

    from ember.weights.gguf_quants import dequantize, q5_0_as_q8_0

    w = (np.random.default_rng(2).standard_normal((24, 96)) * 0.3).astype(np.float32)
    q5 = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)))
    q8 = q5_0_as_q8_0(q5)
    assert q8.shape == (24, 96 // 32 * 34)
    assert torch.equal(dequantize(q8, "Q8_0"), dequantize(q5, "Q5_0"))
