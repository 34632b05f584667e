"""Decode steps from device graphs (ember.worker.graphs): the static tensors, padding and
per-step refills a captured forward reads, checked on CPU tensors with the Triton
attention under the interpreter and with the PyTorch-ops attention Gaudi runs.

There are no device graphs on a CPU: here each "replay" runs the forward again
(`ember.plugin.backend.eager_capture`) through the same static tensors a CUDA graph would
read, so what is checked is that those tensors carry each step's batch (a graph
that read stale metadata would give other tokens). The capture itself
(torch.cuda.CUDAGraph) runs only on a GPU (benchmarks/device_check.py)."""

from __future__ import annotations

import logging
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it: no GPU here

import pytest
import torch

pytest.importorskip("triton")

from ember import EngineConfig, SamplingParams
from ember.engine.llm_engine import LLMEngine
from ember.hardware.triton_attention import TritonAttention
from ember.plugin import create_plugin_manager, hookimpl
from ember.plugin.backend import eager_capture
from ember.testing import check_graph_attention
from ember.worker.graphs import default_graph_sizes


@pytest.fixture(scope="module")
def interpreted_cuda():
    return create_plugin_manager().registries.backends.get("cuda").interpreted()


@pytest.fixture(scope="module", params=["cuda", "gaudi"])
def interpreted(request):
    """cuda's Triton attention, and gaudi's PyTorch-ops attention (fixed-width tables)."""
    return create_plugin_manager().registries.backends.get(request.param).interpreted()


def _engine(model_dir, backend_cls, **engine_args) -> LLMEngine:
    class Plugin:
        @hookimpl
        def ember_register_backends(self, registry):
            registry.register("under-test", backend_cls)

    config = EngineConfig(model=str(model_dir), dtype="float32", backend="under-test", num_kv_tokens=2048,
                          block_size=16, **engine_args)
    return LLMEngine(config, create_plugin_manager(extra_plugins=(("under-test", Plugin()),)))


def _run(engine: LLMEngine) -> list[list[int]]:
    """Requests that join and finish at different steps, so decode batches of 1 to 6
    requests replay graphs of every captured size, with padding rows."""
    prompts = [[(11 * i + j) % 250 + 3 for j in range(5 + 7 * i)] for i in range(6)]
    ids = []
    done = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
        ids.append(engine.add_request(None, params, prompt_token_ids=prompt))
        for out in engine.step():  # one step between arrivals: prompts beside decodes
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def test_decode_graphs_give_the_eager_tokens_with_padding_and_refilled_metadata(interpreted, tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ember.worker.graphs"):
        graphed = _engine(tiny_llama_dir, interpreted, graph_sizes=(1, 2, 4, 8))
    assert "captured 4 decode graphs (batch sizes 1,2,4,8) in" in caplog.text
    graphs = graphed.runner.graphs
    replays = {size: 0 for size in graphs.sizes}
    for size, (replay, metadata) in list(graphs.graphs.items()):
        def counting(replay=replay, size=size):
            replays[size] += 1
            return replay()

        graphs.graphs[size] = (counting, metadata)
    tokens = _run(graphed)
    eager = _engine(tiny_llama_dir, interpreted, enforce_eager=True)
    assert eager.runner.graphs is None
    assert tokens == _run(eager)
    assert all(replays[size] for size in (1, 2, 4, 8)), replays  # every size replayed, most of them padded


def test_a_gemma_2_with_sliding_windows_and_soft_caps_decodes_through_graphs_as_on_the_cpu(
    interpreted, tmp_path_factory,
):
    """A tiny Gemma 2 (sliding layers with a window of 6 keys around a global one, attention
    soft-cap 50): its layers pass window= and softcap= to the device attention, in prompts
    longer than the window, chunks and padded decode graphs; the tokens are the CPU
    backend's."""
    from ember.testing.tiny_models import make_tiny_model

    model_dir = tmp_path_factory.mktemp("tiny-gemma2")
    make_tiny_model("gemma2", model_dir, seed=3)
    tokens = {}
    for name, engine in (("device", _engine(model_dir, interpreted, graph_sizes=(1, 4), max_num_batched_tokens=24)),
                         ("cpu", LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_tokens=2048,
                                                        block_size=16, enforce_eager=True)))):
        tokens[name] = _run(engine)
    assert tokens["device"] == tokens["cpu"]


def test_a_float32_model_graphs_its_few_row_batches_and_graph_sizes_are_validated(tiny_llama_dir, caplog):
    # batches of up to 8 rows multiply through the native float32 GEMV, which a CPU graph
    # records; larger ones are PyTorch GEMMs, which it cannot (tests/test_cpu_graphs.py)
    with caplog.at_level(logging.INFO, logger="ember.worker.graphs"):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_tokens=512))
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == (1, 2, 3, 4, 5, 6, 7, 8)
    # (oneDNN's linear, or F.linear's aten.mm where oneDNN's is unavailable)
    assert re.search(r"decode graphs of batch sizes 12,16,24,32 refused \(they run eagerly\): the "
                     r"forward computes (mkldnn._linear_pointwise|aten.mm).default outside the native kernels",
                     caplog.text), caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember.worker.graphs"):  # the GEMV off: every size refused
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_tokens=512,
                                        backend_options={"small_batch_rows": 0}))
    assert engine.backend.graph_capture() is not None and engine.runner.graphs is None
    assert re.search(r"decode graphs of batch sizes 1,2,3,4,5,6,7,8,12,16,24,32 refused", caplog.text), caplog.text
    with pytest.raises(ValueError, match=r"graph_sizes must be positive integers, got \[4, 0\]"):
        EngineConfig(graph_sizes=(4, 0))
    assert EngineConfig(graph_sizes=(8, 1, 8)).graph_sizes == (1, 8)


def test_default_graph_sizes():
    assert default_graph_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert default_graph_sizes(1024)[-1] == 256
    assert default_graph_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_graph_sizes(3) == (1, 2, 3)


class StaleSlots(TritonAttention):
    """Refills the step's slots but leaves the padding rows' slots from the step
    before: a replay would write those rows' K/V into another request's blocks."""

    def fill_graph_metadata(self, metadata, batch):
        n = batch.block_table.shape[0]
        super().fill_graph_metadata(metadata, batch)
        metadata.slot_mapping[n:] = torch.arange(n, metadata.slot_mapping.shape[0]) + 3


def test_the_graph_check_catches_padding_that_writes_the_cache(interpreted_cuda):
    check_graph_attention(interpreted_cuda(), padding=2)
    leaky = type("Leaky", (interpreted_cuda,), {"create_attention": lambda self: StaleSlots()})
    # caught in the output (a context slot overwritten) or in the cache (a slot nobody owns)
    with pytest.raises(AssertionError, match="differs from the reference|changed that this step's tokens do not own"):
        check_graph_attention(leaky(), padding=2)


def test_eager_capture_runs_the_function_at_each_replay():
    calls = []
    replay = eager_capture(lambda: calls.append(1) or torch.ones(1))
    replay()
    assert len(calls) == 2


def test_serve_flags_reach_the_engine_config():
    from ember.api.cli_env import parse_graph_sizes
    from ember.api.settings import ServerSettings, engine_config_kwargs

    assert parse_graph_sizes("1,2, 8") == (1, 2, 8) and parse_graph_sizes("0") == ()
    for bad in ("", "1,x", "-2", "0,4"):
        with pytest.raises(ValueError, match="batch sizes separated by commas"):
            parse_graph_sizes(bad)
    kwargs = engine_config_kwargs(ServerSettings(graph_sizes=(1, 4), enforce_eager=True))
    assert kwargs["graph_sizes"] == (1, 4) and kwargs["enforce_eager"] is True
    assert "graph_sizes" not in engine_config_kwargs(ServerSettings())
