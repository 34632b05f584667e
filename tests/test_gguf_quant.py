"""GGUF quant types kept quantized: dequantization bit for bit against `gguf`, the native
kernels (every instruction set this CPU runs) against the dequantized float linear,
the GGUF quantizer plugin, and SmolLM2 Q4_1 served natively against its float32
conversion (slow).

Kernel tolerances. The kernels quantize each activation row to 8 bits per block of 32
(llama.cpp's scheme), then multiply integers exactly. Two checks, per output:
* against ``x̂ @ W.T`` in float64, where x̂ is the activation the kernel actually used
  (its int8 blocks times their scales): only float32 rounding differs, so
  ``|y - ref| <= 1e-5 * sum_i |W_ni x̂_i|`` (float32 epsilon 1.2e-7, times the few
  hundred additions of the longest sum, with margin);
* against the float linear ``x @ W.T``: rounding x to 8 bits moves each x_i by at most
  half its block's step d_b = max|x_b| / 127, so ``|y - x @ W.T| <= sum_b d_b / 2 *
  sum_{i in b} |W_ni|`` plus the float32 term above. This bound is what "8-bit
  activations" costs, and it is proven, not fitted.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from ember.hardware import cpu_quant
from ember.hardware.cpu_paths import cpu_flags
from ember.weights import gguf_quants
from ember.weights.gguf_quants import QUANT_TYPES

# byte offsets of each type's float16 scale fields inside a block
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # those gguf.quants.quantize writes


def random_blocks(name: str, rows: int, columns: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """Random bytes of `rows` x `columns` values of type `name`, with finite float16 scales."""
    qt = QUANT_TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, columns // qt.block_size, qt.type_size), dtype=np.uint8)
    for offset in F16_FIELDS[name]:
        values = (rng.standard_normal(raw.shape[:-1]) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = values.view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(rows, -1)


def assert_bits_equal(got: torch.Tensor, expected: np.ndarray) -> None:
    assert got.dtype == torch.float32 and expected.dtype == np.float32
    assert tuple(got.shape) == expected.shape
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


# --- dequantization ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_dequantize_random_blocks_bit_exact(name):
    raw = random_blocks(name, 5, 3 * QUANT_TYPES[name].block_size, seed=1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert_bits_equal(gguf_quants.dequantize(torch.from_numpy(raw), name), expected)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequantize_quantized_values_bit_exact(name):
    rng = np.random.default_rng(2)
    values = (rng.standard_normal((6, 128)) * np.array([[1e-3], [0.1], [1], [10], [0], [300]])).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[name])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    got = gguf_quants.dequantize(torch.from_numpy(raw), name)
    assert_bits_equal(got, expected)
    assert torch.allclose(got, torch.from_numpy(values), atol=float(np.abs(values).max()) / 4 + 1e-6)


def test_dequantize_errors_name_the_type():
    with pytest.raises(ValueError, match="'IQ2_XXS' is not supported.*Q4_1"):
        gguf_quants.quant_type("IQ2_XXS")
    with pytest.raises(ValueError, match="not whole blocks of 20 bytes"):
        gguf_quants.dequantize(torch.zeros(3, 30, dtype=torch.uint8), "Q4_1")
    with pytest.raises(ValueError, match="uint8"):
        gguf_quants.dequantize(torch.zeros(3, 20, dtype=torch.int8), "Q4_1")
    with pytest.raises(ValueError, match="blocks of 256 values; a row of 300"):
        QUANT_TYPES["Q6_K"].row_bytes(300)


# --- kernels -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_quant.load()
    if loaded is None:
        pytest.skip("native GGUF kernels cannot be built here (no AVX2/FMA or no C compiler)")
    return loaded


RUNNABLE_ISAS = cpu_quant.runnable_isas(cpu_flags())
SHAPES = [(1, 7, 256), (3, 33, 512), (8, 64, 768), (5, 1, 1536)]  # (rows, out_features, in_features)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("name", cpu_quant.KERNEL_TYPES)
def test_kernel_matches_dequantized_linear(kernels, isa, name):
    for seed, (rows, out_features, in_features) in enumerate(SHAPES):
        data = torch.from_numpy(random_blocks(name, out_features, in_features, seed=seed))
        w = gguf_quants.dequantize(data, name).double()
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)) * 3
        bias = torch.randn(out_features)
        y = kernels.linear(x, data, name, bias, isa=isa).double()
        assert y.shape == (rows, out_features)

        q, d, _ = kernels.quantize_activations(x)
        steps = d.double().repeat_interleave(32, dim=1)
        x_used = q.double() * steps
        assert ((x_used - x.double()).abs() <= steps / 2 + 1e-6 * x.double().abs()).all()
        float_err = 1e-5 * (x_used.abs() @ w.abs().T) + 1e-6
        exact = x_used @ w.T + bias.double()
        assert ((y - exact).abs() <= float_err).all(), (y - exact).abs().max()
        act_err = (steps / 2) @ w.abs().T
        reference = x.double() @ w.T + bias.double()
        assert ((y - reference).abs() <= act_err + float_err).all()


@pytest.mark.parametrize("name", cpu_quant.KERNEL_TYPES)
def test_native_dequantize_and_many_rows_equal_the_float_linear(kernels, name):
    data = torch.from_numpy(random_blocks(name, 40, 512, seed=3))
    w = gguf_quants.dequantize(data, name)
    assert torch.equal(kernels.dequantize(data, name, 512).view(torch.int32), w.view(torch.int32))
    x = torch.randn(cpu_quant.MAX_KERNEL_ROWS + 5, 512)
    assert torch.equal(kernels.linear(x, data, name), torch.nn.functional.linear(x, w))


def test_isa_selection_and_forcing():
    avx2 = {"avx2", "fma", "f16c"}
    vnni = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert cpu_quant.select_isa(avx2, {})[0] == "avx2"
    assert cpu_quant.select_isa(vnni, {})[0] == "avx512vnni"
    assert cpu_quant.select_isa(vnni, {"EMBER_QUANT_ISA": "ref"}) == ("ref", "forced by EMBER_QUANT_ISA")
    with pytest.raises(ValueError, match="EMBER_QUANT_ISA='avx512vnni': this CPU lacks avx512f"):
        cpu_quant.select_isa(avx2, {"EMBER_QUANT_ISA": "avx512vnni"})
    with pytest.raises(ValueError, match="'sse' is not one of"):
        cpu_quant.select_isa(avx2, {"EMBER_QUANT_ISA": "sse"})
    with pytest.raises(RuntimeError, match="lacks avx2, fma"):
        cpu_quant.select_isa({"sse2"}, {})


def test_kernel_errors_name_the_problem(kernels):
    data = torch.from_numpy(random_blocks("Q4_1", 4, 64))
    with pytest.raises(ValueError, match=r"must be contiguous uint8 \(N, 40\)"):
        kernels.linear(torch.randn(1, 64), data[:, :20].contiguous(), "Q4_1")
    with pytest.raises(ValueError, match="float32 x"):
        kernels.linear(torch.randn(1, 64, dtype=torch.float64), data, "Q4_1")
    with pytest.raises(ValueError, match="'F8' is not supported"):
        kernels.linear(torch.randn(1, 64), data, "F8")


@pytest.mark.slow
def test_dequantize_every_smollm2_tensor_bit_exact(smollm2_gguf):
    reader = gguf.GGUFReader(smollm2_gguf)
    types = set()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name not in QUANT_TYPES:
            assert name in gguf_quants.FLOAT_TYPES
            continue
        types.add(name)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert_bits_equal(gguf_quants.dequantize(torch.from_numpy(np.array(tensor.data)), name), expected)
    assert types == {"Q4_1", "Q8_0"}
