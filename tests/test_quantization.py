"""The quantizer contract, --quantize int8 / int4 on CPU, and their errors
(docs/quantization.md). Checkpoint formats: tests/test_quantization_formats.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.hardware.cpu import CPUBackend
from ember.models.layers import Linear
from ember.plugin.quantized_weights import Int4Weight, Int8Weight, pack_nibbles, unpack_nibbles
from ember.plugin.quantizer import QuantizedLinearOp, select_quantizer
from ember.plugins.quantizers.weight_only import Int4Quantizer, Int8Quantizer, quantize_int4, quantize_int8
from ember.testing import check_quantized_linear_op, check_quantizer
from tests.quant_checkpoints import assert_close_logits, load, logits, registries, tiny_float_model


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return tiny_float_model(tmp_path_factory.mktemp("quant") / "llama")


def _dequantized_logits(model_dir, quantize):
    """Ember with the quantized weights, and Ember with each quantized linear replaced by
    its dequantized float weight (F.linear in float32): the op against its reference."""
    from tests.quant_checkpoints import forward

    model, attention, backend = load(model_dir, quantize)
    got = forward(model, attention, backend, torch.float32)
    for module in model.modules():
        if isinstance(module, Linear) and module.qweights is not None:
            weight = torch.cat([w.dequantize(torch.float32) for w in module.qweights])
            module.qweights = None
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            module.linear_op = F.linear
    return got, forward(model, attention, backend, torch.float32)


# -- weight-only quantization at load ------------------------------------------------

def test_int8_and_int4_grids_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    q8 = quantize_int8(w)
    # per channel: within half a step of the row's scale, and exact on the row's max
    assert (q8.dequantize() - w).abs().le(q8.scales * 0.5 + 1e-6).all()
    q4 = quantize_int4(w, 32)
    step = q4.scales.repeat_interleave(32, 1)
    assert (q4.dequantize() - w).abs().le(step * 0.5 + 1e-6).all()
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(values)), values)
    with pytest.raises(ValueError, match="do not divide in_features 96"):
        quantize_int4(torch.randn(8, 96), 64)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantizer", [Int8Quantizer(), Int4Quantizer()], ids=["int8", "int4"])
def test_weight_only_quantizers_pass_the_conformance_check(quantizer, compute_dtype):
    torch.manual_seed(1)
    check_quantizer(quantizer, {"weight": torch.randn(96, 256)}, CPUBackend(), compute_dtype=compute_dtype)


def test_the_conformance_check_catches_a_wrong_op():
    class OffByOneGroup(QuantizedLinearOp):  # reads the scales of the next group
        format = "int4"
        max_relative_error = 2**-7

        def __call__(self, x, weight, bias=None):
            bad = Int4Weight(weight.qweight, weight.scales.roll(1, dims=1), weight.offsets)
            return F.linear(x, bad.dequantize(x.dtype), bias)

    weight = quantize_int4(torch.randn(32, 128), 32)
    with pytest.raises(AssertionError, match="relative to the dequantized float linear"):
        check_quantized_linear_op(OffByOneGroup(), weight)

    class DropsBias(QuantizedLinearOp):
        format = "int8"

        def __call__(self, x, weight, bias=None):
            return F.linear(x, weight.dequantize(x.dtype))

    with pytest.raises(AssertionError, match="with a bias"):
        check_quantized_linear_op(DropsBias(), quantize_int8(torch.randn(32, 64)))


def test_int8_model_runs_its_kernel_within_tolerance_of_its_dequantized_weights(float_dir):
    got, want = _dequantized_logits(float_dir, "int8")
    # the kernels take bf16 activations and give bf16 outputs (docs/quantization.md): on
    # this random model's near-tied logits that moves a few argmaxes
    assert_close_logits(got, want, rtol=0.05, min_argmax=0.9)


def test_int4_model_runs_its_kernel_within_tolerance_of_its_dequantized_weights(float_dir):
    got, want = _dequantized_logits(float_dir, "int4-g32")
    assert_close_logits(got, want, rtol=0.05, min_argmax=0.9)


def test_int8_and_int4_models_stay_near_the_float_model(float_dir):
    reference = logits(float_dir)
    # int8 per channel: close to the float model; int4 in groups of 32: further, but the
    # same model (a wrong layout would give unrelated logits)
    assert_close_logits(logits(float_dir, "int8"), reference, rtol=0.1, min_argmax=0.9)
    int4 = logits(float_dir, "int4-g32")
    assert torch.corrcoef(torch.stack([int4.flatten(), reference.flatten()]))[0, 1] > 0.75


def test_quantized_linears_keep_no_float_weight_and_report_their_bytes(float_dir, caplog):
    from ember.models.loader import model_weight_bytes

    caplog.set_level("INFO", logger="ember.models.loader")
    model, _, _ = load(float_dir, "int4")
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.is_quantized]
    assert len(quantized) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    for module in quantized:
        assert module.weight is None and "weight" not in dict(module.named_parameters())
        assert module.quant_parts == [None] * len(module.output_sizes)  # loaded parts dropped
    total, packed, formats = model_weight_bytes(model)
    float_model, _, _ = load(float_dir)
    float_total, _, _ = model_weight_bytes(float_model)
    linear_float = sum(m.weight.numel() * 4 for m in float_model.modules()
                       if isinstance(m, Linear) and m.weight is not None and m is not float_model.lm_head)
    assert formats == {"int4": 8}
    assert total == float_total - linear_float + packed
    assert packed < linear_float / 4  # 4 bits a weight plus scales, against 32
    assert any("model weights resident" in r.message and "8 x int4 linears" in r.message for r in caplog.records)


def test_fused_parts_join_into_one_weight(float_dir):
    model, _, _ = load(float_dir, "int8")
    qkv = model.layers[0].self_attn.qkv_proj
    assert len(qkv.qweights) == 1 and qkv.qweights[0].shape == (sum(qkv.output_sizes), qkv.in_features)


def test_greedy_tokens_of_an_int8_model_through_the_engine(float_dir):
    from ember import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["hello world", "the quick brown fox"]
    want = [o.outputs[0].token_ids for o in LLM(model=str(float_dir)).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(model=str(float_dir), quantize="int8").generate(prompts, params)]
    # int8 per channel keeps these greedy tokens (the second prompt's 11th token, a near
    # tie on this random model, is where they part)
    assert got == want


def test_bf16_models_quantize_too(float_dir):
    got, want = logits(float_dir, "int8", dtype=torch.bfloat16), logits(float_dir, dtype=torch.bfloat16)
    assert_close_logits(got, want, rtol=0.15, min_argmax=0.85)


# -- errors ------------------------------------------------------------------------

def test_unknown_and_unbuilt_quantizers_are_refused_by_name():
    quantizers = registries().quantizers
    with pytest.raises(ValueError, match=r"unknown quantizer 'int3' \(--quantize\); registered: awq, "):
        select_quantizer(quantizers, None, "int3")
    with pytest.raises(ValueError, match="--quantize eetq is not supported: EETQ"):
        select_quantizer(quantizers, None, "eetq")
    with pytest.raises(ValueError, match="--quantize gptq reads checkpoints already quantized that way"):
        select_quantizer(quantizers, None, "gptq")
    with pytest.raises(ValueError, match="quant_method 'hqq', which no registered quantizer reads"):
        select_quantizer(quantizers, {"quant_method": "hqq"}, None)
    with pytest.raises(ValueError, match="--quantize int8 does not match the checkpoint, which is quantized with 'awq'"):
        select_quantizer(quantizers, {"quant_method": "awq", "bits": 4, "group_size": 32}, "int8")
    assert select_quantizer(quantizers, None, None) is None


def test_engine_config_refuses_a_bad_quantize_value():
    from ember.config import EngineConfig

    with pytest.raises(ValueError, match="quantize must be a quantizer's name"):
        EngineConfig(quantize="")
    with pytest.raises(ValueError, match="dequantize must be True or False"):
        EngineConfig(dequantize="yes")


def test_a_format_the_backend_does_not_run_is_refused_naming_both_or_dequantized(float_dir, monkeypatch, caplog):
    monkeypatch.setattr(CPUBackend, "quantized_linear_op", lambda self, fmt, dtype: None)
    monkeypatch.setattr(CPUBackend, "quantized_formats", lambda self, dtype: ())
    with pytest.raises(ValueError, match=r"the cpu backend does not run 'int8' weights \(from quantizer 'int8'\) in "
                                         r"torch.float32; it runs: none. Pass --dequantize"):
        load(float_dir, "int8")
    caplog.set_level("WARNING", logger="ember.plugin.quantizer")
    model, _, _ = load(float_dir, "int8", dequantize=True)
    assert any("dequantized to torch.float32 at load" in r.message for r in caplog.records)
    assert not any(isinstance(m, Linear) and m.is_quantized for m in model.modules())


def test_mismatched_shapes_are_refused_naming_the_linear():
    linear = Linear(64, [32, 16], False, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"quantized weight part 1: expected shape \(16, 64\), got \(32, 64\)"):
        linear.load_part(1, "weight", quantize_int8(torch.randn(32, 64)))
    linear.load_part(0, "weight", quantize_int8(torch.randn(32, 64)))
    with pytest.raises(ValueError, match=r"missing part\(s\) \[1\]"):
        linear.set_quantized_op(CPUBackend().quantized_linear_op("int8", torch.float32))
    with pytest.raises(ValueError, match="part 1 is a float weight, but other parts of this linear are quantized"):
        linear.load_part(1, "weight", torch.randn(16, 64))
    with pytest.raises(ValueError, match="scales of shape"):
        Int8Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3))
    with pytest.raises(ValueError, match="qweight must be a 2-D uint8"):
        Int4Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), torch.zeros(4, 1))


def test_parts_that_cannot_join_run_one_by_one():
    torch.manual_seed(2)
    a, b = quantize_int4(torch.randn(16, 64), 32), quantize_int4(torch.randn(32, 64), 64)
    linear = Linear(64, [16, 32], True, torch.float32, torch.float32)
    linear.bias.data.copy_(torch.randn(48))
    linear.load_part(0, "weight", a)
    linear.load_part(1, "weight", b)
    linear.set_quantized_op(CPUBackend().quantized_linear_op("int4", torch.float32))
    assert len(linear.qweights) == 2  # different group sizes
    x = torch.randn(3, 64)
    want = F.linear(x, torch.cat([w.dequantize() for w in linear.qweights]), linear.bias)
    assert (linear(x) - want).abs().max() <= 2**-7 * want.abs().max()


_MISALIGNED = """
import torch
from ember.hardware.cpu import CPUBackend
from ember.plugins.quantizers.weight_only import quantize_int8
from ember.plugin.quantized_weights import Int8Weight

torch.manual_seed(0)
w = quantize_int8(torch.randn(64, 64))
buf = torch.empty(64 * 64 + 64, dtype=torch.int8)
off = buf[40:40 + 64 * 64].view(64, 64).copy_(w.qweight)  # 40 bytes past a boundary
assert off.data_ptr() % 64 != 0
op = CPUBackend().quantized_linear_op("int8", torch.bfloat16)
misaligned, reference = op.prepare(Int8Weight(off, w.scales)), op.prepare(w)
for rows in (1, 57):
    big = torch.randn(rows * 64 + 8, dtype=torch.bfloat16)
    x = big[4:4 + rows * 64].view(rows, 64)  # 8 bytes past a boundary
    got, want = op(x, misaligned), op(x.clone(), reference)
    assert torch.equal(got, want), (got - want).abs().max()
print("ok")
"""


def test_int8_op_takes_operands_off_a_64_byte_boundary():
    """_weight_int8pack_mm's AVX-512 path crashed the process (SIGSEGV) on a weight read
    from a safetensors file at an unaligned address, and on activations that are a view
    into a larger buffer; the op copies such operands. Run in a child process, so a
    crash fails this test instead of ending the suite."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _MISALIGNED], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


def test_cli_flags_reach_the_engine_config():
    from ember.api.cli import build_parser
    from ember.api.settings import ServerSettings, engine_config_kwargs

    args = build_parser().parse_args(["serve", "--quantize", "int4", "--dequantize"])
    assert (args.quantize, args.dequantize) == ("int4", True)
    kwargs = engine_config_kwargs(ServerSettings(quantize="int4", dequantize=True))
    assert (kwargs["quantize"], kwargs["dequantize"]) == ("int4", True)
