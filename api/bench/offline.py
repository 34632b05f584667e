"""The same figures for the in-process engine: requests join the engine at their
arrival times (at most `max_concurrency` unfinished), and each engine step timestamps
the tokens it produced, per request."""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections import deque
from typing import Any

from tqdm import tqdm

from ember.api.bench.arrivals import arrival_times
from ember.api.bench.datasets import BenchRequest
from ember.api.bench.metrics import RequestRecord, build_result
from ember.api.bench.serve import LoadConfig, describe_load


def benchmark_offline(engine: Any, requests: list[BenchRequest], load: LoadConfig, temperature: float = 0.0,
                      ignore_eos: bool = True, label: str = "offline",
                      extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `requests` through `engine` (an idle `ember.engine.llm_engine.LLMEngine`) and return the
    result (see `metrics.build_result`). A request the engine refuses (ValueError:
    too long for the context, ...) is a failure, not an exception."""
    from ember import SamplingParams
    from ember.engine.input_processor import apply_chat_template

    if engine.has_unfinished_requests():
        raise RuntimeError("benchmark_offline needs an idle engine")

    def params(request: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=request.max_tokens, ignore_eos=ignore_eos)

    def inputs(request: BenchRequest) -> tuple[str | None, list[int] | None]:
        if request.prompt_token_ids is not None:
            return None, list(request.prompt_token_ids)
        if request.messages is not None:
            # as the server's chat route: the template holds any BOS, encoding adds none
            prompt = apply_chat_template(engine.tokenizer, request.as_messages())
            return prompt, engine.tokenizer.encode(prompt, add_special_tokens=False)
        return request.prompt, None

    for request in requests[: load.num_warmups]:
        prompt, ids = inputs(request)
        engine.add_request(prompt, params(request), prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            engine.step()

    times = arrival_times(len(requests), load.request_rate, load.burstiness, load.seed)
    records = [RequestRecord(i, t) for i, t in enumerate(times)]
    waiting = deque(zip(requests, records))
    running: dict[str, RequestRecord] = {}
    progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr,
                    disable=not load.show_progress, dynamic_ncols=True)
    started_at = dt.datetime.now(dt.timezone.utc)
    run_start = time.perf_counter()
    try:
        while waiting or running:
            now = time.perf_counter() - run_start
            while waiting and waiting[0][1].scheduled_s <= now and (
                load.max_concurrency is None or len(running) < load.max_concurrency
            ):
                request, record = waiting.popleft()
                record.start_s = time.perf_counter() - run_start
                record.output_tokens_source = "engine"
                try:
                    prompt, ids = inputs(request)
                    request_id = engine.add_request(prompt, params(request), prompt_token_ids=ids)
                except ValueError as exc:
                    record.error = f"refused: {exc}"
                    progress.update()
                    continue
                record.num_input_tokens = len(ids) if ids is not None else None
                running[request_id] = record
            if not running:
                if waiting:
                    time.sleep(max(0.0, waiting[0][1].scheduled_s - (time.perf_counter() - run_start)))
                continue
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine stopped with {len(running)} request(s) unfinished")
            outputs = engine.step()
            step_end = time.perf_counter() - run_start
            for out in outputs:
                record = running.get(out.request_id)
                if record is None:
                    continue
                if record.num_input_tokens is None:
                    record.num_input_tokens = len(out.prompt_token_ids)
                if out.new_token_ids:
                    record.chunk_times_s.append(step_end - record.start_s)
                    if record.ttft_s is None:
                        record.ttft_s = step_end - record.start_s
                if out.finished:
                    record.e2el_s = step_end - record.start_s
                    record.num_output_tokens = len(out.outputs[0].token_ids)
                    del running[out.request_id]
                    progress.update()
    except BaseException:
        for request_id in running:
            engine.abort_request(request_id)
        raise
    finally:
        progress.close()
    duration_s = time.perf_counter() - run_start
    config = {"temperature": temperature, "ignore_eos": ignore_eos, **describe_load(load), **(extra_config or {})}
    return build_result("offline", config, records, duration_s, started_at, label)
