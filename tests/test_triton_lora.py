"""Ember's Triton multi-LoRA kernels (ember.hardware.triton_lora: BGMV shrink and expand)
run on CPU tensors under Triton's interpreter, against a plain per-token PyTorch loop:
several adapter slots mixed in one batch, base-model tokens (slot -1) left bitwise
untouched, ranks 8/16/64, a stride rank of 48 holding three stacked 16-rank parts (a fused
projection's LoRAs, each writing its own output section), unused rank rows, sizes that are
not multiples of the blocks, row-strided views, float32, bf16 and fp16, T = 0 and T = 1;
and the accelerator backends handing the op out (Gaudi, without Triton, does not)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it: no GPU here

import pytest
import torch

from ember.hardware.cuda import CUDABackend
from ember.hardware.gaudi import GaudiBackend
from ember.hardware.rocm import ROCmBackend
from ember.hardware.xpu import XPUBackend

triton_lora = pytest.importorskip("ember.hardware.triton_lora")


def test_the_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"


def reference(y, x, a, bt, token_slots, rank):
    """The contract, one token at a time: float32 products, the sum written in y's dtype."""
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s != -1:
            rows = slice(s * rank, (s + 1) * rank)
            delta = (x[t].float() @ a[rows].float().T) @ bt[rows].float()
            out[t] = (y[t].float() + delta).to(y.dtype)
    return out


def make(tokens, slots, rank, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    y = torch.randn(tokens, n, generator=g).to(dtype)
    a = (torch.randn(slots * rank, k, generator=g) / k**0.5).to(dtype)
    bt = torch.randn(slots * rank, n, generator=g).to(dtype)
    return y, x, a, bt


# bf16: up to one ulp, as Triton's interpreter casts float32 to bf16 by truncation (its
# _convert_float without a rounding mode), where a GPU rounds to nearest; fp16 rounds alike
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2},
             torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


def check(y, x, a, bt, token_slots, rank):
    want = reference(y, x, a, bt, token_slots, rank)
    got = y.clone()
    triton_lora.lora_op(got, x, a, bt, token_slots, rank)
    base = token_slots == -1
    assert torch.equal(got[base], y[base])  # base-model rows never written
    torch.testing.assert_close(got, want, **TOLERANCE[y.dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_a_batch_mixing_three_adapters_and_the_base_model(rank, dtype):
    """11 tokens over slots 0..2 and -1 in no order, in 72 -> out 200 (neither a multiple
    of a block)."""
    token_slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 1, -1, 0, 2])
    y, x, a, bt = make(len(token_slots), 3, rank, 72, 200, dtype, seed=rank)
    got = check(y, x, a, bt, token_slots, rank)
    assert not torch.equal(got[token_slots != -1], y[token_slots != -1])  # the update did land


@pytest.mark.parametrize(("rank", "k"), [(8, 1100), (64, 300)])
def test_the_shrink_walks_in_over_several_blocks(rank, k):
    """``in`` over two and a part blocks of the shrink (``block_sizes``: 512 columns at rank
    8, 128 at rank 64): every block adds to the sum."""
    assert 2 * triton_lora.block_sizes(rank)["shrink_k"] < k < 3 * triton_lora.block_sizes(rank)["shrink_k"]
    token_slots = torch.tensor([1, -1, 0, 1])
    y, x, a, bt = make(len(token_slots), 2, rank, k, 24, torch.float32, seed=k)
    check(y, x, a, bt, token_slots, rank)


def test_a_stride_rank_of_48_holds_three_16_rank_parts_each_writing_its_section():
    """A fused projection (q, k, v sections of 64, 32, 32 outputs): each slot's 48 rows of
    ``a`` are three parts' A, its rows of ``bt`` each part's B^T in its own section (zero
    elsewhere); the kernel's result equals each part's product added to its section."""
    torch.manual_seed(3)
    parts, part_rank, k, sections = 3, 16, 40, [(0, 64), (64, 96), (96, 128)]
    rank, slots, token_slots = parts * part_rank, 2, torch.tensor([1, 0, -1, 1, 0])
    a_parts = torch.randn(slots, parts, part_rank, k)
    b_parts = [[torch.randn(part_rank, hi - lo) for lo, hi in sections] for _ in range(slots)]
    a = a_parts.reshape(slots * rank, k)
    bt = torch.zeros(slots * rank, 128)
    for s in range(slots):
        for p, (lo, hi) in enumerate(sections):
            bt[s * rank + p * part_rank : s * rank + (p + 1) * part_rank, lo:hi] = b_parts[s][p]
    x, y = torch.randn(5, k), torch.randn(5, 128)
    got = check(y, x, a, bt, token_slots, rank)
    want = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        for p, (lo, hi) in enumerate(sections):
            if s != -1:
                want[t, lo:hi] += (x[t] @ a_parts[s, p].T) @ b_parts[s][p]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_adapter_of_a_lower_rank_in_zero_padded_rows():
    """Slot 0 has rank 4 in a max rank of 16 (rows 4..15 zero): the same as its rank-4 product."""
    torch.manual_seed(4)
    y, x, a, bt = make(3, 2, 16, 24, 20, torch.float32, seed=4)
    a[4:16], bt[4:16] = 0, 0
    token_slots = torch.tensor([0, 1, 0])
    got = check(y, x, a, bt, token_slots, 16)
    torch.testing.assert_close(got[0], y[0] + (x[0] @ a[:4].T) @ bt[:4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_single_token(dtype):
    y, x, a, bt = make(1, 4, 8, 33, 17, dtype, seed=5)
    check(y, x, a, bt, torch.tensor([3]), 8)


def test_no_tokens_and_only_base_tokens():
    y, x, a, bt = make(0, 2, 8, 16, 16, torch.float32, seed=6)
    triton_lora.lora_op(y, x, a, bt, torch.zeros(0, dtype=torch.int64), 8)
    assert y.shape == (0, 16)
    y, x, a, bt = make(3, 2, 8, 16, 16, torch.float32, seed=6)
    check(y, x, a, bt, torch.full((3,), -1), 8)


def test_rank_192_and_row_strided_views():
    """The largest rank (64 x 3 parts: a 256-rank block in the expand, three shrink blocks);
    ``x`` and ``y`` slices of wider rows, the columns around ``y`` untouched."""
    torch.manual_seed(7)
    rank, token_slots = 192, torch.tensor([1, -1, 0])
    _, _, a, bt = make(3, 2, rank, 24, 40, torch.float32, seed=7)
    x_wide, y_wide = torch.randn(3, 30), torch.randn(3, 50)
    x, y = x_wide[:, 3:27], y_wide[:, 5:45]
    want = reference(y, x, a, bt, token_slots, rank)
    before = y_wide.clone()
    triton_lora.lora_op(y, x, a, bt, token_slots, rank)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y_wide[:, :5], before[:, :5]) and torch.equal(y_wide[:, 45:], before[:, 45:])
    assert torch.equal(y_wide[1], before[1])


def test_shapes_that_do_not_fit_are_refused():
    y, x, a, bt = make(2, 2, 8, 16, 12, torch.float32, seed=8)
    with pytest.raises(ValueError, match="do not fit"):
        triton_lora.lora_op(y, x, a, bt, torch.zeros(2, dtype=torch.int64), 5)  # 16 rows, not slots x 5


def test_the_triton_backends_hand_out_the_op_and_gaudi_does_not():
    """Construction touches no device (the backend contract), so this needs no GPU."""
    for cls in (CUDABackend, ROCmBackend, XPUBackend):
        assert cls().lora_op() is triton_lora.lora_op
        assert cls.interpreted()().lora_op() is triton_lora.lora_op
    assert GaudiBackend().lora_op() is None
