"""Drive an OpenAI-compatible server: requests sent at their arrival times, at most
`max_concurrency` in flight, a progress bar on stderr."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from ember.api.bench.arrivals import arrival_times
from ember.api.bench.client import ClientConfig, fetch_model_name, send_request
from ember.api.bench.datasets import BenchRequest
from ember.api.bench.metrics import RequestRecord, build_result


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive: `request_rate` per second (inf: all at once), gamma gaps of
    shape `burstiness`, at most `max_concurrency` in flight (None: no cap)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 0
    timeout_s: float = 600.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")
        arrival_times(0, self.request_rate, self.burstiness)  # validates both


def benchmark_serve(client_config: ClientConfig, load: LoadConfig, requests: list[BenchRequest],
                    tokenizer: Any | None = None, label: str | None = None,
                    extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark and return its result (see `metrics.build_result`).
    ``client_config.model`` may be empty: it is then read from ``/v1/models``."""
    return asyncio.run(_benchmark(client_config, load, requests, tokenizer, label, extra_config or {}))


async def _benchmark(client_config: ClientConfig, load: LoadConfig, requests: list[BenchRequest],
                     tokenizer: Any | None, label: str | None, extra_config: dict[str, Any]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=load.max_concurrency)
    timeout = httpx.Timeout(load.timeout_s, connect=min(load.timeout_s, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if not client_config.model:
            model = await fetch_model_name(client, client_config.base_url, client_config.headers)
            client_config = ClientConfig(**{**asdict(client_config), "model": model})
        for request in requests[: load.num_warmups]:
            await send_request(client, client_config, request, RequestRecord(-1, 0.0), time.perf_counter(), tokenizer)
        times = arrival_times(len(requests), load.request_rate, load.burstiness, load.seed)
        records = [RequestRecord(i, t) for i, t in enumerate(times)]
        slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        progress = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr,
                        disable=not load.show_progress, dynamic_ncols=True)
        num_failed = 0

        async def run_one(request: BenchRequest, record: RequestRecord, run_start: float) -> None:
            nonlocal num_failed
            if slots is None:
                await send_request(client, client_config, request, record, run_start, tokenizer)
            else:
                async with slots:
                    await send_request(client, client_config, request, record, run_start, tokenizer)
            num_failed += not record.is_success
            progress.set_postfix(failed=num_failed, refresh=False)
            progress.update()

        started_at = dt.datetime.now(dt.timezone.utc)
        run_start = time.perf_counter()
        tasks = []
        try:
            for request, record in zip(requests, records):
                delay = run_start + record.scheduled_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run_one(request, record, run_start)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            progress.close()
        duration_s = time.perf_counter() - run_start
    config = {
        "base_url": client_config.base_url,
        "endpoint": client_config.endpoint,
        "model": client_config.model,
        "temperature": client_config.temperature,
        "ignore_eos": client_config.ignore_eos,
        "extra_body": client_config.extra_body,
        **describe_load(load),
        **extra_config,
    }
    return build_result("serve", config, records, duration_s, started_at, label or client_config.base_url)


def describe_load(load: LoadConfig) -> dict[str, Any]:
    values = asdict(load)
    values.pop("show_progress")
    values["request_rate"] = "inf" if math.isinf(load.request_rate) else load.request_rate
    return values
