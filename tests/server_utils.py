"""A real Ember HTTP server for tests: uvicorn on 127.0.0.1, an ephemeral port, a thread.

    with running_server(tiny_llama_dir, max_total_tokens=128) as (url, app):
        httpx.post(f"{url}/generate", json={"inputs": "hi"})

Keyword arguments are `ServerSettings` fields; `engine` overrides `EngineConfig`
fields (default: float32, 128 KV blocks of 8 tokens; the core in a thread unless
``engine_mode="process"``); `tracer_provider` goes to
`create_app`; `wrap` serves ``wrap(app)`` instead of the app. The server is yielded
once ready (its warm-up request has run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from starlette.applications import Starlette

STARTUP_TIMEOUT_S = 60.0


def wait_idle(app: Starlette, timeout: float = 10.0) -> None:
    """Until no API request is being served: a client has its whole response a moment
    before the server has recorded the request (metrics, spans, access log)."""
    deadline = time.monotonic() + timeout
    while app.state.lifecycle.num_active:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{app.state.lifecycle.num_active} request(s) still being served after {timeout} s")
        time.sleep(0.005)


class RunningServer(NamedTuple):
    url: str  # http://127.0.0.1:<port>, no trailing slash
    app: Starlette


@contextmanager
def running_server(
    model_dir: Path | str, engine: dict[str, Any] | None = None, tracer_provider: Any = None,
    wrap: Callable[[Starlette], Any] | None = None, **settings: Any,
) -> Iterator[RunningServer]:
    import uvicorn

    from ember.api.server import create_app
    from ember.api.settings import ServerSettings
    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncLLMEngine
    from ember.engine.llm_engine import LLMEngine

    engine_kwargs = {"model": str(model_dir), "dtype": "float32", "num_kv_blocks": 128, "block_size": 8}
    engine_kwargs.update(engine or {})
    settings.setdefault("engine_mode", "thread")  # the engine built here, in this process (fast to start)
    if settings["engine_mode"] == "process":
        async_engine = AsyncLLMEngine.with_engine_process(EngineConfig(**engine_kwargs))
    else:
        async_engine = AsyncLLMEngine(LLMEngine(EngineConfig(**engine_kwargs)))
    app = create_app(async_engine, ServerSettings(**{"model_id": str(model_dir), **settings}), tracer_provider)
    served = app if wrap is None else wrap(app)  # e.g. Ember mounted in a parent app (its lifespan passed on)
    server = uvicorn.Server(uvicorn.Config(served, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="ember-test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        lifecycle = app.state.lifecycle
        while not server.started or not (lifecycle.is_ready or lifecycle.warm_up_error is not None):
            if not thread.is_alive():
                raise RuntimeError("the test server exited during startup (see the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test server did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield RunningServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        async_engine.shutdown()  # in case the app's shutdown hook did not run
