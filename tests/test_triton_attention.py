"""Ember's Triton paged-attention and KV-write kernels (ember.hardware.triton_attention)
run on CPU tensors under Triton's interpreter, checked by the backend conformance
kit's attention check (float64 reference, every other cache slot unchanged) on
mixed prefill / chunked-prefill / decode batches with scattered block tables, odd
head sizes and GQA, in float32 and bf16, and against the CPU backend's attention; with
sliding windows and logit soft-caps (each, and both) in float32, bf16 and fp16, through
the step kernels and the static (graph) decode metadata."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it: no GPU here

import pytest
import torch

from ember.hardware.cpu import CPUAttention, CPUBackend
from ember.plugin.backend import AttentionBatch, SequenceSlice
from ember.testing.backend_conformance import attention_limits, check_attention, check_graph_attention

triton_attention = pytest.importorskip("ember.hardware.triton_attention")


class TritonOnCPU(CPUBackend):
    """The CPU backend with Triton's attention: the kernels under the interpreter."""

    name = "triton-interpret"

    def create_attention(self):
        return triton_attention.TritonAttention(block_n=16)


def test_the_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: not a power of two (masked lanes)
def test_triton_attention_passes_the_conformance_kit(dtype, head_dim):
    check_attention(TritonOnCPU(), dtype=dtype, head_dim=head_dim, seed=head_dim)


LIMITS = attention_limits(triton_attention.TritonAttention())[1:]  # window, softcap, both


def test_triton_attention_declares_windows_and_soft_caps():
    assert LIMITS == [(5, None), (None, 0.75), (5, 0.75)]


@pytest.mark.parametrize(("dtype", "window", "softcap"), [
    *((torch.float32, *limits) for limits in LIMITS),
    *((torch.bfloat16, *limits) for limits in LIMITS),
    (torch.float16, 5, 0.75),
])
def test_triton_attention_with_limits_passes_the_conformance_kit(dtype, window, softcap):
    """What `check_backend` runs for each limit the attention declares, prefills, chunks
    and decodes of one step and then the graph form's decodes (head size 24: masked lanes)."""
    backend = TritonOnCPU()
    check_attention(backend, dtype=dtype, head_dim=24, seed=7, window=window, softcap=softcap)
    check_graph_attention(backend, dtype=dtype, head_dim=24, seed=7, window=window, softcap=softcap)


@pytest.mark.parametrize(("window", "softcap"), [(6, None), (6, 2.0)])
def test_keys_before_the_window_are_never_read(window, softcap):
    """Every K/V row before the window of a step's earliest query is NaN: a kernel that
    read one (even masked) would return NaN. Tiles of 32 queries over key blocks of 16,
    so that a tile's later rows see no key in its first block (their running maximum
    stays -inf there). A 40-token prompt, a chunk of 33 after 50 cached tokens and a
    decode at 90, block size 16, GQA 4 / 2; the CPU backend's attention on a clean cache
    is the reference."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 16, 20
    shape = [(0, 40), (50, 33), (90, 1)]  # (cached, new)
    perm = torch.randperm(num_blocks).tolist()
    slices, used = [], 0
    for cached, new in shape:
        n = -(-(cached + new) // block_size)
        slices.append(SequenceSlice(new, cached, perm[used : used + n]))
        used += n
    batch = AttentionBatch.from_slices(slices, block_size, torch.device("cpu"))
    tokens = sum(new for _, new in shape)
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    clean = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    poisoned = clean.clone()
    for s in slices:  # the cached positions before the window of the request's first query
        for position in range(max(0, s.start_position - window + 1)):
            poisoned[:, s.block_table[position // block_size], position % block_size] = float("nan")
    reference = CPUAttention(None)
    want = reference.forward(q, k, v, clean, reference.prepare(batch), dim**-0.5, window=window, softcap=softcap)
    attention = triton_attention.TritonAttention(block_n=16, block_m=32)
    got = attention.forward(q, k, v, poisoned, attention.prepare(batch), dim**-0.5, window=window, softcap=softcap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_window_under_one_or_a_cap_not_above_zero_is_refused():
    attention = triton_attention.TritonAttention()
    batch = AttentionBatch.from_slices([SequenceSlice(2, 0, [0])], 4, torch.device("cpu"))
    q, kv, cache = torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.zeros(2, 1, 4, 2, 16)
    for limits, message in (({"window": 0}, "window must be a positive number of positions, got 0"),
                            ({"softcap": 0.0}, "softcap must be positive, got 0.0")):
        with pytest.raises(ValueError, match=message):
            attention.forward(q, kv, kv, cache, attention.prepare(batch), 0.25, **limits)


def test_triton_attention_with_gqa_matches_the_cpu_backend_on_a_mixed_step():
    """9 query heads over 3 KV heads (SmolLM2's grouping), block size 16, a prompt, a
    chunk after 37 cached tokens and three decodes in one flat batch."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 32, 16, 40
    shape = [(0, 21), (37, 11), (5, 1), (16, 1), (70, 1)]  # (cached, new)
    perm = torch.randperm(num_blocks).tolist()
    slices, used = [], 0
    for cached, new in shape:
        n = -(-(cached + new) // block_size)
        slices.append(SequenceSlice(new, cached, perm[used : used + n]))
        used += n
    batch = AttentionBatch.from_slices(slices, block_size, torch.device("cpu"))
    tokens = sum(new for _, new in shape)
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = CPUAttention(None).forward(q, k, v, want_cache, CPUAttention(None).prepare(batch), dim**-0.5)
    attention = triton_attention.TritonAttention(block_n=16)
    got = attention.forward(q, k, v, got_cache, attention.prepare(batch), dim**-0.5)
    assert torch.equal(got_cache, want_cache)  # the same slots written, nothing else touched
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_k_and_v_may_be_row_strided_views_of_a_fused_projection():
    torch.manual_seed(1)
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(6, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(6, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(6, kv_heads, dim)
    batch = AttentionBatch.from_slices([SequenceSlice(6, 0, [3, 1])], 4, torch.device("cpu"))
    cache = torch.zeros(2, 5, 4, kv_heads, dim)
    attention = triton_attention.TritonAttention()
    got = attention.forward(q, k, v, cache, attention.prepare(batch), 0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.25, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flat = cache.view(2, 20, kv_heads, dim)
    slots = batch.slot_mapping
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
