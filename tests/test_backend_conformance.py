"""The backend conformance check (`ember.testing.check_backend`): the CPU backend passes
it, and backends with one planted defect each fail it with a message naming the defect."""

from __future__ import annotations

import unittest

import pytest
import torch

from ember.hardware.cpu import CPUAttention, CPUBackend
from ember.testing import check_backend, check_backend_basics


def test_cpu_backend_conforms():
    check_backend(CPUBackend)


def test_cpu_backend_conforms_with_small_heads():
    check_backend(CPUBackend, head_dim=16, seed=1)


def test_cpu_backend_conforms_without_native_kernels():
    check_backend(backend_with(CPUAttention))


# --- planted defects: each must be caught -------------------------------------------------------


def backend_with(attention_cls: type[CPUAttention], kernels=None, **attrs) -> type[CPUBackend]:
    return type("BrokenBackend", (CPUBackend,), {"create_attention": lambda self: attention_cls(kernels), **attrs})


class NonCausalPrefill(CPUAttention):
    """Prefill queries also see later tokens of their own request."""

    def forward(self, q, k, v, kv_cache, metadata, scale):
        out = super().forward(q, k, v, kv_cache, metadata, scale)
        for group in metadata.prefills:
            if group.cached_slots is None and group.token_end - group.token_start > 1:
                qs = q[group.token_start : group.token_end].transpose(0, 1)
                ks = k[group.token_start : group.token_end].transpose(0, 1)
                vs = v[group.token_start : group.token_end].transpose(0, 1)
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
                out[group.token_start : group.token_end] = o.transpose(0, 1)
        return out


class DecodeSeesWholeTable(CPUAttention):
    """Decodes attend to every slot of their block tables, past the context too."""

    def prepare(self, batch):
        metadata = super().prepare(batch)
        block_size = batch.block_size
        if metadata.decode_lens is not None:
            whole = metadata.decode_tables.shape[1] * block_size
            metadata.decode_lens = torch.full_like(metadata.decode_lens, whole)
            metadata.decode_mask = None
        return metadata


class WritesAStraySlot(CPUAttention):
    """Writes this step's first key once more, into a slot nobody owns."""

    def forward(self, q, k, v, kv_cache, metadata, scale):
        out = super().forward(q, k, v, kv_cache, metadata, scale)
        used = set(metadata.slot_mapping.tolist())
        stray = next(s for s in range(kv_cache.shape[1] * kv_cache.shape[2]) if s not in used)
        kv_cache[0].view(-1, *kv_cache.shape[3:])[stray] = k[0]
        return out


class ForgetsTheLastToken(CPUAttention):
    """Skips writing the last token of the batch into the cache (attention still right)."""

    def forward(self, q, k, v, kv_cache, metadata, scale):
        slot = metadata.slot_mapping[-1]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        saved = flat[:, slot].clone()
        out = super().forward(q, k, v, kv_cache, metadata, scale)
        flat[:, slot] = saved
        return out


class MutatesMetadata(CPUAttention):
    """Consumes the metadata in the first layer, so the second layer gets no decodes."""

    def forward(self, q, k, v, kv_cache, metadata, scale):
        out = super().forward(q, k, v, kv_cache, metadata, scale)
        if metadata.decode_lens is not None:
            metadata.decode_token_index = metadata.decode_lens = None
            metadata.prefills = []
        return out


class IgnoresTheWindow(CPUAttention):
    """Declares sliding windows but attends over the whole context."""

    def forward(self, q, k, v, kv_cache, metadata, scale, *, window=None, softcap=None):
        return super().forward(q, k, v, kv_cache, metadata, scale, softcap=softcap)


class WindowOneShort(CPUAttention):
    """Off by one: a window of w keys is taken as w - 1."""

    def forward(self, q, k, v, kv_cache, metadata, scale, *, window=None, softcap=None):
        return super().forward(q, k, v, kv_cache, metadata, scale, softcap=softcap,
                               window=None if window is None else window - 1)


class IgnoresTheSoftcap(CPUAttention):
    """Declares logit soft-capping but never caps."""

    def forward(self, q, k, v, kv_cache, metadata, scale, *, window=None, softcap=None):
        return super().forward(q, k, v, kv_cache, metadata, scale, window=window)


@pytest.mark.parametrize(
    "attention_cls, message",
    [
        (IgnoresTheWindow, "window 5: layer 0"),
        (WindowOneShort, "window 5: layer 0"),
        (IgnoresTheSoftcap, "softcap 0.75: layer 0"),
        (NonCausalPrefill, "differs from the reference"),
        (DecodeSeesWholeTable, "differs from the reference"),
        (WritesAStraySlot, "changed that this step's tokens do not own"),
        (ForgetsTheLastToken, "was not written to its slot"),
        (MutatesMetadata, "layer 1"),
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["pytorch", "native"])
def test_attention_defects_are_caught(attention_cls, message, native, request):
    kernels = request.getfixturevalue("native_kernels") if native else None
    with pytest.raises(AssertionError, match=message):
        check_backend(backend_with(attention_cls, kernels))


def test_lenient_resolve_dtype_is_caught():
    lenient = backend_with(CPUAttention, resolve_dtype=lambda self, requested, model_dtype: torch.float32)
    with pytest.raises(AssertionError, match="did not raise ValueError"):
        check_backend_basics(lenient)


def test_is_available_that_raises_is_caught():
    def is_available(cls):
        raise RuntimeError("no driver")

    broken = backend_with(CPUAttention, is_available=classmethod(is_available))
    with pytest.raises(AssertionError, match="is_available\\(\\) raised"):
        check_backend_basics(broken)


def test_missing_float32_is_caught():
    bf16_only = backend_with(CPUAttention, supported_dtypes=property(lambda self: (torch.bfloat16,)))
    with pytest.raises(AssertionError, match="lacks torch.float32"):
        check_backend_basics(bf16_only)


def test_unavailable_backend_is_skipped():
    absent = backend_with(CPUAttention, is_available=classmethod(lambda cls: False))
    with pytest.raises(unittest.SkipTest, match="not available"):
        check_backend(absent)


def test_attention_without_limits_is_checked_plain_only():
    """A backend written for plugin API 1.0 (no window, no softcap) still conforms:
    the limited checks run only for what an attention declares."""
    from ember.testing.backend_conformance import attention_limits

    class Plain(CPUAttention):
        supports_sliding_window = False
        supports_softcap = False

        def forward(self, q, k, v, kv_cache, metadata, scale):  # the 1.0 signature
            return super().forward(q, k, v, kv_cache, metadata, scale)

    assert attention_limits(Plain()) == [(None, None)]
    assert len(attention_limits(CPUAttention())) == 4
    check_backend(backend_with(Plain))


def test_models_needing_limits_are_refused_on_attention_without_them():
    from ember.plugin.backend import require_attention_features

    class Plain(CPUAttention):
        supports_sliding_window = False
        supports_softcap = False

    require_attention_features(CPUAttention(), "Gemma2ForCausalLM", window=True, softcap=True)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM needs sliding-window attention and attention logit "
                                         "soft-capping, which the attention 'cpu'"):
        require_attention_features(Plain(), "Gemma2ForCausalLM", window=True, softcap=True)
    require_attention_features(Plain(), "LlamaForCausalLM")
