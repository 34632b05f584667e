"""Ember's Triton paged-attention and KV-write kernels (ember.hardware.triton_attention)
run on CPU tensors under Triton's interpreter, checked by the backend conformance
kit's attention check (float64 reference, every other cache slot unchanged) on
mixed prefill / chunked-prefill / decode batches with scattered block tables, odd
head sizes and GQA, in float32 and bf16, and against the CPU backend's attention."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it: no GPU here

import pytest
import torch

from ember.hardware.cpu import CPUAttention, CPUBackend
from ember.plugin.backend import AttentionBatch, SequenceSlice
from ember.testing.backend_conformance import check_attention

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
