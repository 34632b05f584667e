"""The engine core in its own process (`ember serve --engine-mode process`): the same
tokens as in a thread, streaming, stop strings, parallel sampling, aborts, bad input,
and a core that dies is reported, never hangs a request."""

import asyncio
import os
import signal

import httpx
import pytest
from server_utils import running_server

from ember import SamplingParams
from ember.config import EngineConfig
from ember.engine.async_engine import AsyncLLMEngine
from ember.engine.llm_engine import LLMEngine
from ember.errors import EngineDeadError

PROMPTS = ["Hello there", "The capital of", "1 2 3 4"]


def _config(model_dir):
    # batch-invariant products: a request's numbers must not depend on which requests
    # share its steps, which differs between a core in a thread and one behind a pipe
    # (the few-row GEMV takes up to 8 rows, oneDNN more: the rounding of a step of 8 and
    # of 9 rows differs, and a sampled token's logprob with it)
    return EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8,
                        backend_options={"batch_invariant": "1"})


async def _collect(engine, prompt, params, **kwargs):
    outs = [out async for out in engine.generate(prompt, params, **kwargs)]
    return outs


def _run_all(engine, jobs):
    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(_collect(engine, p, params) for p, params in jobs))
        finally:
            engine.shutdown()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def thread_results(tiny_llama_dir):
    jobs = _jobs()
    return _run_all(AsyncLLMEngine(LLMEngine(_config(tiny_llama_dir))), jobs)


def _jobs():
    return [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(temperature=0.8, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(temperature=0.9, seed=9, n=2, best_of=3, max_tokens=6, ignore_eos=True)),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, stop=["e"], ignore_eos=True)),
    ]


def test_the_core_in_a_process_gives_the_same_outputs_as_in_a_thread(tiny_llama_dir, thread_results):
    engine = AsyncLLMEngine.with_engine_process(_config(tiny_llama_dir))
    assert engine.engine_mode == "process" and engine._process.is_alive
    results = _run_all(engine, _jobs())
    for got, want in zip(results, thread_results):
        assert [c.token_ids for c in got[-1].outputs] == [c.token_ids for c in want[-1].outputs]
        assert [c.text for c in got[-1].outputs] == [c.text for c in want[-1].outputs]
        assert [c.logprobs for c in got[-1].outputs] == [c.logprobs for c in want[-1].outputs]
        assert "".join(o.new_text for o in got) == "".join(o.new_text for o in want)
    assert not engine._process.is_alive, "shutdown stops the core's process"


def test_bad_input_and_aborts_leave_the_core_process_serving(tiny_llama_dir):
    engine = AsyncLLMEngine.with_engine_process(_config(tiny_llama_dir))

    async def main():
        engine.start()
        try:
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await _collect(engine, None, SamplingParams(), prompt_token_ids=[1, 10**6])
            # a stream left early aborts its request in the core
            agen = engine.generate("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            for _ in range(200):
                if engine.stats().num_running == 0:
                    break
                await asyncio.sleep(0.02)
            outs = await _collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            stats = engine.stats()
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_core_process_that_dies_fails_its_requests_and_the_next_ones(tiny_llama_dir):
    engine = AsyncLLMEngine.with_engine_process(_config(tiny_llama_dir))

    async def main():
        engine.start()
        try:
            agen = engine.generate("Hello", SamplingParams(max_tokens=100000 // 1000, ignore_eos=True))
            await agen.__anext__()
            os.kill(engine._process.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="engine-core process exited"):
                async for _ in agen:
                    pass
            assert not engine.is_running
            with pytest.raises(EngineDeadError):
                await _collect(engine, "Hello", SamplingParams(max_tokens=2))
        finally:
            engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_model_the_core_process_cannot_load_is_an_error_at_start(tmp_path):
    with pytest.raises(Exception, match="config.json|not a model|No such file|does not exist"):
        AsyncLLMEngine.with_engine_process(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8))


def test_the_server_with_the_core_in_a_process(tiny_llama_dir):
    with running_server(tiny_llama_dir, engine_mode="process") as (url, app):
        r = httpx.post(f"{url}/v1/completions", json={"model": "x", "prompt": "Hello", "max_tokens": 5,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 5
        chunks = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
        }) as s:
            assert s.status_code == 200
            chunks = [line for line in s.iter_lines() if line.startswith("data:")]
        assert chunks[-1] == "data: [DONE]"
        info = httpx.get(f"{url}/info", timeout=10).json()
        assert info["max_total_tokens"] > 0
        r = httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 0}}, timeout=10)
        assert r.status_code == 422


def test_many_streams_with_stop_strings_and_aborts_in_process_mode(tiny_llama_dir):
    """The event loop (adds, aborts) and the reader thread (stop-string finishes) both
    write to the core's pipe: under load every request still ends as it should."""
    engine = AsyncLLMEngine.with_engine_process(_config(tiny_llama_dir))

    async def one(i):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=24, stop=["e", "a"], ignore_eos=True)
        agen = engine.generate(f"prompt {i}", params)
        if i % 3 == 0:  # leave early: an abort from the event loop
            await agen.__anext__()
            await agen.aclose()
            return None
        outs = [out async for out in agen]
        return outs[-1]

    async def main():
        engine.start()
        try:
            finals = await asyncio.gather(*(one(i) for i in range(24)))
            for i, out in enumerate(finals):
                if out is not None:
                    assert out.finished and out.outputs[0].finish_reason in ("stop", "length"), (i, out)
            for _ in range(200):
                stats = engine.stats()
                if stats.num_running == 0 and stats.num_waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
