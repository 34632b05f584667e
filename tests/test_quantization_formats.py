"""Quantized checkpoint formats on tiny random Llamas (docs/quantization.md).

Each checkpoint is written in its format's layout: by the format's own library where it
installs here without another torch (compressed-tensors, bitsandbytes), else by the
published layout re-stated in this file (GPTQ: AutoGPTQ's pack; AWQ: AutoAWQ's GEMM
pack). Its float twin holds the library's own dequantization (or this file's
re-statement of the format's formula). Ember's logits on the quantized checkpoint must
match Ember's on the twin within the stated tolerance: 5% of the largest logit and 90%
of argmaxes where the CPU runs the int kernels (bf16 activations on a random model with
near-tied logits), 1e-5 where the weights are dequantized at load (--dequantize).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ember.hardware.cpu import CPUBackend
from ember.plugins.quantizers.awq import AWQQuantizer
from ember.plugins.quantizers.gptq import GPTQQuantizer
from ember.testing import check_quantizer
from tests.quant_checkpoints import assert_close_logits, logits, tiny_float_model, write_quantized

RTOL_KERNEL, ARGMAX_KERNEL = 0.05, 0.9


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    # narrower than the tiny models' usual 0.3: less amplification of the kernels' bf16
    # rounding through the layers, so the stated tolerance is tighter
    return tiny_float_model(tmp_path_factory.mktemp("formats") / "llama", initializer_range=0.15)


def _int32(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 tensors checkpoints store."""
    return torch.from_numpy(values.numpy().astype(np.uint32).view(np.int32))


def _pack_words(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack unsigned values along ``dim``, value ``i`` of each word at bits ``bits * i``
    (``order[i]``: which value of the word's group goes to slot ``i``, AWQ's interleave)."""
    per = 32 // bits
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    words = (v << (torch.arange(per) * bits)).sum(-1)
    return _int32(words.movedim(-1, dim))


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The test's own reading of little-end-first words, for the reference dequantization."""
    w = words.long().movedim(dim, -1) & 0xFFFFFFFF
    per = 32 // bits
    out = torch.stack([(w >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], -1)
    return out.reshape(*w.shape[:-1], -1).movedim(-1, dim)


def _compare(quantized_dir, reference_dir, dequantize=False, dtype=torch.float32):
    got = logits(quantized_dir, dequantize=dequantize, dtype=dtype)
    want = logits(reference_dir, dtype=dtype)
    if dequantize:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    else:
        assert_close_logits(got, want, RTOL_KERNEL, ARGMAX_KERNEL)


# -- GPTQ (AutoGPTQ's pack, published layout) ----------------------------------------

def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, act_order: bool, sym: bool, v1: bool, seed: int):
    n, k = w.shape
    maxq = (1 << bits) - 1
    gen = torch.Generator().manual_seed(seed)
    if act_order:  # GPTQ's act-order: columns visited in a permuted order, groups by visit
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // group_size).to(torch.int32)
    groups = k // group_size
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            scale = (2 * hi / maxq).clamp(min=1e-8)
            zero = torch.full((n,), (maxq + 1) // 2)
        else:
            scale = ((hi - lo) / maxq).clamp(min=1e-8)
            zero = torch.round(-lo / scale).long()
        scales[g], zeros[g] = scale, zero
    scales = scales.half()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]  # (K, N)
    q = torch.clamp(torch.round(w.t() / s) + z, 0, maxq).long()  # (K, N)
    stored = (zeros - 1) & maxq if v1 else zeros
    tensors = {"qweight": _pack_words(q, bits, 0), "qzeros": _pack_words(stored, bits, 1), "scales": scales,
               "g_idx": g_idx}
    # AutoGPTQ's dequantization: scales[g_idx] * (q - (stored_zero + 1)) in the v1 format
    q_read = _unpack_words(tensors["qweight"], bits, 0)
    z_read = _unpack_words(tensors["qzeros"], bits, 1) + (1 if v1 else 0)
    deq = tensors["scales"].float()[g_idx.long()] * (q_read - z_read[g_idx.long()]).float()
    return tensors, deq.t()


@pytest.mark.parametrize(("bits", "act_order", "sym", "v1"), [
    (4, False, True, True), (4, True, True, True), (8, True, False, False), (4, False, False, False),
], ids=["4bit", "4bit-act-order", "8bit-act-order-asym-v2", "4bit-asym-v2"])
def test_gptq_checkpoint(float_dir, tmp_path, bits, act_order, sym, v1):
    config = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": act_order, "sym": sym,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    seeds = iter(range(100))
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", config,
                    lambda prefix, w: gptq_quantize(w, bits, 32, act_order, sym, v1, next(seeds)))
    _compare(tmp_path / "q", tmp_path / "ref")


def test_gptq_conformance_and_errors():
    w = torch.randn(64, 128)
    tensors, deq = gptq_quantize(w, 4, 32, True, True, True, 0)
    quantizer = GPTQQuantizer({"quant_method": "gptq", "bits": 4, "group_size": 32})
    for dtype in (torch.float32, torch.bfloat16):
        check_quantizer(quantizer, tensors, CPUBackend(), compute_dtype=dtype, reference=deq, reference_tolerance=0)
    with pytest.raises(ValueError, match=r"GPTQ with bits=3 is not supported \(4 and 8 are\)"):
        GPTQQuantizer({"quant_method": "gptq", "bits": 3})
    with pytest.raises(ValueError, match="checkpoint_format 'marlin' is not supported"):
        GPTQQuantizer({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})
    bad = dict(tensors, scales=tensors["scales"][:-1])
    with pytest.raises(ValueError, match=r"proj.scales has shape \(3, 64\), expected \(4, 64\)"):
        quantizer.create_weight("model.layers.0.mlp.down_proj", bad, torch.float32)


# -- AWQ (AutoAWQ's GEMM pack, published layout) --------------------------------------

AWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_quantize(w: torch.Tensor, group_size: int):
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()  # (N, G)
    zeros = torch.round(-lo / scales.float()).clamp(0, 15).long()
    q = torch.clamp(torch.round(g / scales.float()[..., None]) + zeros[..., None], 0, 15).long().reshape(n, k)
    tensors = {"qweight": _pack_words(q.t(), 4, 1, AWQ_ORDER_MAP), "qzeros": _pack_words(zeros.t(), 4, 1, AWQ_ORDER_MAP),
               "scales": scales.t().contiguous()}
    # AutoAWQ's dequantization: unpack, undo the order (AWQ_REVERSE_ORDER), (q - z) * s
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]
    def read(words):
        v = _unpack_words(words, 4, 1)
        return v.reshape(v.shape[0], -1, 8)[..., reverse].reshape(v.shape[0], -1)
    qr, zr = read(tensors["qweight"]), read(tensors["qzeros"])  # (K, N), (G, N)
    s = tensors["scales"].float()
    deq = (qr - zr.repeat_interleave(group_size, 0)).float() * s.repeat_interleave(group_size, 0)
    return tensors, deq.t()


def test_awq_checkpoint(float_dir, tmp_path):
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", config, lambda prefix, w: awq_quantize(w, 32))
    _compare(tmp_path / "q", tmp_path / "ref")


def test_awq_conformance_and_errors():
    tensors, deq = awq_quantize(torch.randn(64, 128), 32)
    quantizer = AWQQuantizer({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    check_quantizer(quantizer, tensors, CPUBackend(), reference=deq, reference_tolerance=0)
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported: only the GEMM layout"):
        AWQQuantizer({"quant_method": "awq", "bits": 4, "version": "gemv"})


# -- compressed-tensors (written by the library) ---------------------------------------

def _ct_config(fmt: str, args) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                          "input_activations": None, "output_activations": None}}}


def ct_quantize(w: torch.Tensor, args):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    n, k = w.shape
    if args.strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.type == "float":
        scale = torch.maximum(lo.abs(), hi) / torch.finfo(torch.float8_e4m3fn).max
        zero = torch.zeros_like(scale)
    elif args.symmetric:
        scale = torch.maximum(lo.abs(), hi) / ((1 << (args.num_bits - 1)) - 0.5)
        zero = torch.zeros_like(scale, dtype=torch.int8)
    else:
        qmax = (1 << args.num_bits) - 1
        scale = (hi - lo) / qmax
        zero = (torch.round(-lo / scale) - (1 << (args.num_bits - 1))).clamp(-128, 127).to(torch.int8)
    scale = scale.to(torch.bfloat16)
    if args.type == "float":
        q = quantize(w, scale, zero, args, dtype=torch.float8_e4m3fn)
        tensors = {"weight": q, "weight_scale": scale}
    else:
        q = quantize(w, scale, zero, args, dtype=torch.int8)
        tensors = {"weight_packed": pack_to_int32(q, args.num_bits), "weight_scale": scale,
                   "weight_shape": torch.tensor([n, k])}
        if not args.symmetric:
            tensors["weight_zero_point"] = pack_to_int32(zero, args.num_bits, packed_dim=0)
    deq = dequantize(q, scale, None if args.symmetric else zero, args, dtype=torch.float32)
    return tensors, deq


@pytest.mark.parametrize("scheme", ["w4a16-group-sym", "w8a16-channel-asym", "w4a16-group-asym"])
def test_compressed_tensors_pack_quantized(float_dir, tmp_path, scheme):
    from compressed_tensors.quantization import QuantizationArgs

    bits = 4 if scheme.startswith("w4") else 8
    strategy = "group" if "group" in scheme else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=scheme.endswith("-sym"), strategy=strategy,
                            group_size=32 if strategy == "group" else None)
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", _ct_config("pack-quantized", args),
                    lambda prefix, w: ct_quantize(w, args))
    _compare(tmp_path / "q", tmp_path / "ref")


def test_compressed_tensors_fp8_is_refused_on_cpu_or_dequantized(float_dir, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", _ct_config("float-quantized", args),
                    lambda prefix, w: ct_quantize(w, args))
    with pytest.raises(ValueError, match=r"the cpu backend does not run 'fp8_e4m3' weights \(from quantizer "
                                         r"'compressed-tensors'\)"):
        logits(tmp_path / "q")
    # the library dequantizes in the scale's dtype (bf16): a bf16 model has those numbers
    _compare(tmp_path / "q", tmp_path / "ref", dequantize=True, dtype=torch.bfloat16)


def test_compressed_tensors_refuses_activation_quantization():
    from ember.plugins.quantizers.compressed_tensors import CompressedTensorsQuantizer

    config = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
    with pytest.raises(ValueError, match="quantized input activations is not supported"):
        CompressedTensorsQuantizer(config)


# -- bitsandbytes (written by the library) ----------------------------------------------

def bnb_int8(w: torch.Tensor):
    import bitsandbytes.functional as bnbf

    q, scb, _ = bnbf.int8_vectorwise_quant(w)
    return {"weight": q, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}, \
        bnbf.int8_vectorwise_dequant(q, scb)


def bnb_nf4(w: torch.Tensor, nested: bool):
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=nested)
    tensors = {"weight": packed}
    tensors.update({f"weight.{key}": value for key, value in state.as_dict(packed=True).items()})
    return tensors, bnbf.dequantize_4bit(packed, state)


def test_bitsandbytes_int8_checkpoint(float_dir, tmp_path):
    config = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", config, lambda prefix, w: bnb_int8(w))
    _compare(tmp_path / "q", tmp_path / "ref")


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
def test_bitsandbytes_nf4_is_refused_on_cpu_or_dequantized(float_dir, tmp_path, nested):
    config = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": nested}
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", config, lambda prefix, w: bnb_nf4(w, nested))
    with pytest.raises(ValueError, match=r"does not run 'nf4' weights \(from quantizer 'bitsandbytes-nf4'\)"):
        logits(tmp_path / "q")
    _compare(tmp_path / "q", tmp_path / "ref", dequantize=True)


def test_bitsandbytes_on_a_float_checkpoint_quantizes_rows_at_load(float_dir):
    assert_close_logits(logits(float_dir, "bitsandbytes"), logits(float_dir, "int8"), 1e-6, 1.0)


# -- fp8 (e4m3 with per-tensor / per-channel scales, transformers' layout) ---------------

def fp8_quantize(w: torch.Tensor, per_channel: bool):
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / torch.finfo(torch.float8_e4m3fn).max).float()
    q = (w / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.ones(1)}, q.float() * scale


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_fp8_checkpoint_is_refused_on_cpu_or_dequantized(float_dir, tmp_path, per_channel):
    config = {"quant_method": "fbgemm_fp8" if per_channel else "fp8", "activation_scheme": "static"}
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", config, lambda prefix, w: fp8_quantize(w, per_channel))
    with pytest.raises(ValueError, match=r"does not run 'fp8_e4m3' weights \(from quantizer 'fp8'\)"):
        logits(tmp_path / "q")
    _compare(tmp_path / "q", tmp_path / "ref", dequantize=True)


def test_a_checkpoint_missing_a_quantized_part_is_refused(float_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    write_quantized(float_dir, tmp_path / "q", tmp_path / "ref", config, lambda prefix, w: awq_quantize(w, 32))
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales"):
        del state[f"model.layers.1.self_attn.k_proj.{suffix}"]
    save_file(state, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing quantized part\(s\) \[1\] of linear 'layers.1.self_attn.qkv_proj'"):
        logits(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
