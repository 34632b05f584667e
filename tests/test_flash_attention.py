"""The flash-attn attention of the CUDA and ROCm backends (ember.hardware.flash_attention)
and how a device backend chooses its attention (its option attention).

flash-attn's kernels need a GPU. Here the adapter runs against
tests/flash_attn_reference.py, flash-attn's two paged entry points as its
documentation defines them (with the argument checks its kernels make), and must pass
the backend conformance kit's float64 attention check: this shows that Ember calls
flash-attn as documented, not that flash-attn's kernels are right (a GPU shows that:
benchmarks/device_check.py). Likewise for sliding windows and soft-caps: the arguments
Ember passes (``window_size=(window - 1, 0)``, ``softcap=``) are checked, and the
reference's reading of them passes the kit; flash-attn's kernels computing them is not."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it: no GPU here

import pytest
import torch

pytest.importorskip("triton")

import flash_attn_reference

from ember.hardware.cpu import CPUAttention
from ember.hardware.flash_attention import FlashAttention
from ember.hardware.triton_attention import TritonAttention
from ember.plugin import create_plugin_manager
from ember.plugin.backend import AttentionBatch, SequenceSlice
from ember.testing import check_backend_basics, check_graph_attention
from ember.testing.backend_conformance import attention_limits, check_attention


@pytest.fixture(scope="module")
def backends():
    return create_plugin_manager().registries.backends


@pytest.fixture
def flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_reference)
    return flash_attn_reference


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_adapter_passes_the_conformance_kit_through_flash_attns_documented_api(backends, flash_attn, dtype):
    """Both entry points with 256-token pages (the kit scales its mixed batch so that
    contexts still cross pages), and the static form decode graphs capture."""
    backend = backends.get("cuda").interpreted()()
    assert isinstance(backend.create_attention(), FlashAttention)
    check_attention(backend, dtype=dtype)
    check_graph_attention(backend, dtype=dtype)


def test_the_adapter_with_a_window_and_a_cap_passes_the_conformance_kit(backends, flash_attn):
    """Both limits at once (the kit's window scaled to the 256-token pages): through both
    entry points and the graph form."""
    backend = backends.get("cuda").interpreted()()
    attention = backend.create_attention()
    assert attention.supports_sliding_window and attention.supports_softcap and attention.has_softcap
    check_attention(backend, dtype=torch.bfloat16, window=5, softcap=0.75)
    check_graph_attention(backend, dtype=torch.bfloat16, window=5, softcap=0.75)


def _recording(module, calls: list) -> SimpleNamespace:
    """``module``'s two entry points, each call's keyword arguments appended to ``calls``."""
    def record(name):
        def call(*args, **kwargs):
            calls.append((name, kwargs))
            return getattr(module, name)(*args, **kwargs)
        return call

    return SimpleNamespace(**{name: record(name) for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache")})


def _step(attention, slices, limits, cache=None, seed=0):
    """One bf16 step of ``slices`` (256-token blocks, 4 query / 2 KV heads of 16) through
    ``attention``: its output and the cache."""
    gen = torch.Generator().manual_seed(seed)
    batch = AttentionBatch.from_slices(slices, 256, torch.device("cpu"))
    tokens = sum(s.num_query_tokens for s in slices)
    q, k, v = (torch.randn(tokens, heads, 16, generator=gen).bfloat16() for heads in (4, 2, 2))
    cache = torch.randn(2, 3, 256, 2, 16, generator=gen).bfloat16() if cache is None else cache
    return attention.forward(q, k, v, cache, attention.prepare(batch), 0.25, **limits), cache


PROMPT_AND_CHUNK = [SequenceSlice(3, 0, [1]), SequenceSlice(2, 300, [0, 2])]
DECODES = [SequenceSlice(1, 260, [2, 0]), SequenceSlice(1, 7, [1])]


def test_windows_and_caps_reach_both_entry_points_as_flash_attn_documents_them():
    calls = []
    attention = FlashAttention(_recording(flash_attn_reference, calls))
    for limits in ({}, {"window": 40}, {"softcap": 30}, {"window": 40, "softcap": 30.0}):
        for slices in (PROMPT_AND_CHUNK, DECODES):
            _step(attention, slices, limits)
    expected = [{}, {"window_size": (39, 0)}, {"softcap": 30.0}, {"window_size": (39, 0), "softcap": 30.0}]
    for (name, kwargs), want in zip(calls, [w for w in expected for _ in range(2)]):
        assert {key: kwargs[key] for key in ("window_size", "softcap") if key in kwargs} == want, name
        assert kwargs["causal"] is True and isinstance(kwargs.get("softcap", 0.0), float)
    assert [name for name, _ in calls] == ["flash_attn_varlen_func", "flash_attn_with_kvcache"] * 4
    with pytest.raises(ValueError, match="window must be a positive number of positions, got 0"):
        _step(attention, DECODES, {"window": 0})


def test_a_flash_attn_without_softcap_runs_the_capped_layers_through_triton(caplog):
    """flash-attn before 2.6 (no ``softcap`` keyword): capped layers take the Triton
    kernels, windowed ones stay on flash-attn; a build that refuses a cap when called
    (compiled without it) is found out at its first capped call, the same way."""
    calls = []
    recording = _recording(flash_attn_reference, calls)

    # flash-attn 2.5's signatures (paged KV, windows, no softcap)
    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
               causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
               block_table=None):
        return recording.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, block_table=block_table)

    def with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                     cache_batch_idx=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                     rotary_interleaved=True, alibi_slopes=None, num_splits=0):
        return recording.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                 block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                                                 window_size=window_size)

    old = FlashAttention(SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache))
    triton = TritonAttention()
    assert not old.has_softcap and old.supports_softcap  # the class still honours caps, through Triton
    with caplog.at_level(logging.INFO, logger="ember.hardware.flash_attention"):
        for slices in (PROMPT_AND_CHUNK, DECODES):
            got, _ = _step(old, slices, {"window": 40, "softcap": 30.0})
            want, _ = _step(triton, slices, {"window": 40, "softcap": 30.0})
            assert torch.equal(got, want)
    assert calls == []
    assert "logit soft-capping (this flash-attn has no softcap; 2.6 and later do) runs the Triton" in caplog.text
    _step(old, DECODES, {"window": 40})
    assert [kwargs["window_size"] for _, kwargs in calls] == [(39, 0)]

    def refuses(*args, softcap=0.0, **kwargs):
        if softcap > 0:
            raise RuntimeError("This flash attention build does not support softcap.")
        raise RuntimeError("some other failure")

    built_without = FlashAttention(SimpleNamespace(flash_attn_varlen_func=refuses, flash_attn_with_kvcache=refuses))
    assert built_without.has_softcap
    got, _ = _step(built_without, DECODES, {"softcap": 30.0})
    assert torch.equal(got, _step(triton, DECODES, {"softcap": 30.0})[0]) and not built_without.has_softcap
    with pytest.raises(RuntimeError, match="some other failure"):
        _step(built_without, DECODES, {"window": 40})


def test_float32_which_flash_attn_does_not_take_runs_the_triton_kernels(backends, flash_attn, caplog):
    """The contract (check_backend_basics) and a float32 decode batch through the
    graph form, whose layers fall back to the Triton kernels (their float32 prompts
    and chunks at 256-token blocks are the same kernels test_triton_attention.py
    checks at 4- and 16-token blocks)."""
    backend = check_backend_basics(backends.get("cuda").interpreted())
    with caplog.at_level(logging.INFO, logger="ember.hardware.flash_attention"):
        check_graph_attention(backend, dtype=torch.float32)
    assert "attention: torch.float32 (flash-attn runs float16 and bfloat16) runs the Triton kernels" in caplog.text


def test_an_adapter_that_ignores_the_cached_context_fails_the_kit(backends, flash_attn, monkeypatch):
    original = FlashAttention.prepare

    def forgetful(self, batch):  # keys of the new tokens only: a chunk's cached context is lost
        metadata = original(self, batch)
        lens = torch.tensor(batch.query_lens, dtype=torch.int32)
        metadata.seq_lens = lens
        metadata.cu_seqlens_k = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
        return metadata

    monkeypatch.setattr(FlashAttention, "prepare", forgetful)
    with pytest.raises(AssertionError, match="differs from the reference"):
        check_attention(backends.get("cuda").interpreted()(), dtype=torch.bfloat16)


def test_flash_attn_is_chosen_where_installed_and_triton_otherwise(backends, flash_attn, monkeypatch, caplog):
    for name in ("cuda", "rocm"):
        assert isinstance(backends.get(name)().create_attention(), FlashAttention)
    assert isinstance(backends.get("xpu")().create_attention(), TritonAttention)  # no flash-attn build for XPU
    assert isinstance(backends.get("cuda")({"attention": "triton"}).create_attention(), TritonAttention)
    assert isinstance(backends.get("cuda")({"attention": "torch"}).create_attention(), CPUAttention)


@pytest.mark.parametrize(("name", "options"), [("gaudi", None), ("cuda", {"attention": "torch"})])
def test_the_pytorch_attention_of_the_device_backends_honours_windows_and_caps(backends, name, options):
    """Gaudi's attention, and attention=torch on a GPU backend: the CPU backend's PyTorch
    path (no native kernels), which declares both limits, so that the kit runs them (every
    dtype and limit under ``ember backends check gaudi --interpret``); here both at once."""
    backend = backends.get(name).interpreted()(options)
    attention = backend.create_attention()
    assert isinstance(attention, CPUAttention) and attention.kernels is None
    assert attention_limits(attention) == [(None, None), (5, None), (None, 0.75), (5, 0.75)]
    check_attention(backend, dtype=torch.bfloat16, window=5, softcap=0.75)
    check_graph_attention(backend, dtype=torch.bfloat16, window=5, softcap=0.75)


def test_without_flash_attn_the_gpu_backends_say_so_and_run_triton(backends, no_flash_attn, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="ember.hardware.torch_device"):
        assert isinstance(backends.get("rocm")().create_attention(), TritonAttention)
    assert "attention by Triton paged-attention kernels; flash-attn is not installed" in caplog.text
    with pytest.raises(ValueError, match=r"attention=flash-attn, but flash-attn is not installed"):
        backends.get("cuda")({"attention": "flash-attn"}).create_attention()


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("xpu", "flash-attn", "triton, torch"),
    ("gaudi", "triton", "torch"),
])
def test_an_attention_the_backend_does_not_run_is_refused_by_name(backends, name, value, allowed):
    with pytest.raises(ValueError, match=f"attention='{value}' is not an attention of the {name} backend; "
                                         f"choose auto or one of: {allowed}"):
        backends.get(name)({"attention": value}).create_attention()
    with pytest.raises(ValueError, match=f"the {name} backend's option attention='flashinfer' is invalid: "
                                         "choose one of: auto, flash-attn, triton, torch"):
        backends.get(name)({"attention": "flashinfer"})


def _generate(model_dir, backend_cls, dtype, **engine_args):
    from ember import EngineConfig, SamplingParams
    from ember.engine.llm_engine import LLMEngine
    from ember.plugin import hookimpl

    class Plugin:
        @hookimpl
        def ember_register_backends(self, registry):
            registry.register("under-test", backend_cls)

    # decode graphs of 1 and 4 (eager replays here): more would cost minutes of interpreted capture
    config = EngineConfig(model=str(model_dir), dtype=dtype, backend="under-test", graph_sizes=(1, 4), **engine_args)
    engine = LLMEngine(config, create_plugin_manager(extra_plugins=(("under-test", Plugin()),)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # a long prompt beside short ones: varlen steps with several requests, then decode-only steps
    prompts = [[(7 * i) % 250 + 3 for i in range(200)], [5, 77, 12], list(range(40, 61))]
    ids = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return engine, [done[i] for i in ids]


def test_an_engine_on_flash_attn_takes_256_token_blocks_and_generates_as_triton_does(
    backends, flash_attn, monkeypatch, tiny_llama_dir,
):
    cls = backends.get("cuda").interpreted()
    engine, flash_tokens = _generate(tiny_llama_dir, cls, "bfloat16", num_kv_tokens=1024)
    assert engine.kv_manager.block_size == 256 and engine.num_kv_cache_tokens == 1024
    assert isinstance(engine.runner.attention, FlashAttention)
    engine, triton_tokens = _generate(tiny_llama_dir, cls, "bfloat16", num_kv_tokens=1024,
                                      backend_options={"attention": "triton"})
    assert engine.kv_manager.block_size == 16
    assert flash_tokens == triton_tokens
    with pytest.raises(ValueError, match="block_size 16 does not suit the flash-attn attention, whose paged KV cache "
                                         "needs blocks of a multiple of 256 tokens"):
        _generate(tiny_llama_dir, cls, "bfloat16", num_kv_tokens=1024, block_size=16,
                  backend_options={"attention": "flash-attn"})
