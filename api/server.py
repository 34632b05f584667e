"""The Starlette application and `ember serve`.

The engine runs in its own thread (`AsyncLLMEngine`); the event loop only parses,
validates, queues and streams, so /health answers while a batch computes. The app
uses the engine only through its `EngineClient` interface.
Production concerns (docs/operations.md) wrap the routes: `RequestMiddleware`
(request id, API key, drain gate, metrics, traces, access log), CORS, the warm-up
that makes /health ready, and the SIGTERM drain of `serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from ember.api.errors import APIError, Flavor, error_response
from ember.api.http import REQUEST_ID_HEADER, TRACE_ID_HEADER, RequestMiddleware, flavor_of, route_path
from ember.api.media import fetch_policy, media_limits
from ember.api.observability import ServerMetrics, Tracing, create_otlp_provider
from ember.api.plugin_context import plugin_routes
from ember.api.pooling import create_score_template
from ember.api.responses_store import ResponsesStore
from ember.api.routes.anthropic import MessagesRoutes
from ember.api.routes.common import CommonRoutes
from ember.api.routes.lora import LoRAMetrics, LoRARoutes
from ember.api.routes.media import ServerMedia
from ember.api.routes.openai_chat import ChatRoutes
from ember.api.routes.openai_completions import CompletionRoutes
from ember.api.routes.openai_embeddings import EmbeddingRoutes
from ember.api.routes.openai_responses import ResponsesRoutes
from ember.api.routes.playground import PlaygroundRoutes
from ember.api.routes.rerank import RerankRoutes
from ember.api.routes.tgi import TGIRoutes
from ember.api.service import GenerationService, Lifecycle, ServedModel
from ember.api.settings import ServerSettings, engine_config_kwargs, resolve_limits
from ember.engine.async_engine import AsyncLLMEngine
from ember.engine.client import EngineClient
from ember.engine.supervisor import RestartPolicy

logger = logging.getLogger(__name__)


def _flavor(request: Request) -> Flavor:
    return flavor_of(route_path(request.scope))


async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    error_type = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(APIError(exc.status_code, message, error_type), _flavor(request))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, f"internal error: {exc!r}", "internal"), _flavor(request))


def create_app(engine: EngineClient, settings: ServerSettings, tracer_provider=None) -> Starlette:
    """Build the app around a started or startable engine (started on app startup).

    ``tracer_provider``: an OpenTelemetry SDK provider to trace with (tests pass one
    with an in-memory exporter); without one, ``settings.otlp_endpoint`` makes one.
    """
    import ember

    model = engine.model_info
    limits = resolve_limits(settings, model.max_model_len, model.num_kv_cache_tokens, model.max_num_batched_tokens)
    model_id = settings.served_model_name or settings.model_id or model.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
    info = ServedModel(
        model_id=model_id,
        dtype=model.dtype,
        backend=model.backend_name,
        version=ember.__version__,
        created=int(time.time()),
        reasoning_parser=settings.reasoning_parser,
        tool_call_parser=settings.tool_call_parser,
    )
    if settings.tool_call_parser is not None and settings.tool_call_parser not in engine.plugin_manager.registries.tool_parsers:
        registered = ", ".join(engine.plugin_manager.registries.tool_parsers.names()) or "none"
        raise ValueError(f"--tool-call-parser {settings.tool_call_parser!r} is not a registered tool-call parser; "
                         f"registered: {registered}")
    service = GenerationService(engine, limits, info)
    if model_id in engine.adapters():
        raise ValueError(f"--lora-modules: adapter name {model_id!r} is the served model's name; choose another")
    service.adapter_parents.update({m.name: m.base_model_name for m in settings.lora_modules if m.base_model_name})
    service.media = ServerMedia(engine, model_id, media_limits(settings), fetch_policy(settings), settings.model_impl,
                                service.run_blocking)
    lifecycle = Lifecycle(engine, settings.graceful_termination_timeout)
    metrics = ServerMetrics(engine, in_flight=lambda: service.num_in_flight)
    if model.lora is not None:
        LoRAMetrics(engine, metrics)
    if tracer_provider is not None:
        tracing = Tracing(tracer_provider)
    elif settings.otlp_endpoint is not None:
        tracing = Tracing(create_otlp_provider(settings.otlp_endpoint, settings.otlp_service_name), owns_provider=True)
    else:
        tracing = Tracing(None)
    routes = CommonRoutes(service, lifecycle).routes() + TGIRoutes(service).routes() + metrics.routes()
    routes += CompletionRoutes(service).routes() + ChatRoutes(service).routes()
    routes += MessagesRoutes(service).routes()
    store = ResponsesStore(settings.responses_store_size, settings.responses_store_ttl)
    routes += ResponsesRoutes(service, store).routes()
    routes += LoRARoutes(service, settings.enable_lora_runtime_updates).routes()
    score_template = create_score_template(settings.score_template, settings.score_tokens, engine.encode)
    routes += EmbeddingRoutes(service).routes() + RerankRoutes(service, score_template).routes()
    routes += PlaygroundRoutes().routes()  # `/` and `/ui`: the web playground (docs/playground.md)
    routes += plugin_routes(service, {route.path for route in routes})
    from ember.api.openapi import OpenAPIRoutes

    routes += OpenAPIRoutes(routes).routes()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        warm_up = asyncio.get_running_loop().create_task(lifecycle.warm_up())
        try:
            yield
        finally:
            warm_up.cancel()
            service.close()
            engine.shutdown()
            tracing.shutdown()

    middleware = []
    if settings.cors_allow_origins:
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(settings.cors_allow_origins), allow_methods=["*"],
            allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER.decode(), TRACE_ID_HEADER.decode()],
        ))
    middleware.append(Middleware(
        RequestMiddleware, metrics=metrics, tracing=tracing, lifecycle=lifecycle, api_key=settings.api_key,
        known_paths=frozenset(route.path for route in routes), payload_limit=settings.payload_limit,
        body_timeout_s=settings.request_body_timeout, root_path=settings.root_path,
    ))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.lifecycle = lifecycle
    app.state.metrics = metrics
    app.state.tracing = tracing
    return app


def build_engine(settings: ServerSettings) -> AsyncLLMEngine:
    from ember.config import EngineConfig
    from ember.engine.llm_engine import LLMEngine
    from ember.plugin import create_plugin_manager

    config = EngineConfig(**engine_config_kwargs(settings))
    pm = create_plugin_manager(disabled=config.disabled_plugins, required=config.required_plugins)
    grammar_backends = pm.registries.grammar_backends
    if config.grammar_backend not in grammar_backends:
        raise ValueError(
            f"--grammar-backend {config.grammar_backend!r} is not a registered grammar backend; "
            f"registered: {', '.join(grammar_backends.names()) or 'none'}"
        )
    if settings.engine_mode == "process":
        policy = RestartPolicy(settings.max_engine_restarts) if settings.restart_engine_on_failure else None
        return AsyncLLMEngine.with_engine_process(config, pm, restart_policy=policy)
    return AsyncLLMEngine(LLMEngine(config, pm))


def create_server(app: Starlette, settings: ServerSettings):
    """A uvicorn server whose first SIGTERM/SIGINT drains (`Lifecycle.begin_drain`)
    instead of closing the listening socket at once; a second signal stops it now."""
    import uvicorn

    lifecycle: Lifecycle = app.state.lifecycle

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            loop = getattr(self, "_loop", None)
            if sig not in (signal.SIGTERM, signal.SIGINT) or loop is None or lifecycle.is_draining or not self.started:
                super().handle_exit(sig, frame)  # uvicorn's own: stop now
                return
            loop.call_soon_threadsafe(lifecycle.begin_drain, self._drained)

        def _drained(self) -> None:
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)
            self._engine_watch = self._loop.create_task(self._watch_engine())

        async def _watch_engine(self) -> None:
            # An engine that died (a parallel worker lost, the core process gone) serves
            # nothing more: its streams have ended with an error event; new requests get
            # 503 while the server drains, then it exits non-zero for a supervisor to see.
            # With --restart-engine-on-failure dead_error is set only once no restart is left.
            engine = app.state.service.client
            while not self.should_exit:
                error = getattr(engine, "dead_error", None)
                if error is not None:
                    logger.error("the engine stopped (%s); the server shuts down", error)
                    self.engine_died = True
                    lifecycle.begin_drain(self._drained)
                    return
                await asyncio.sleep(0.2)

    config = uvicorn.Config(
        app, host=settings.hostname, port=settings.port, log_level="warning",
        # the drain already waited for the requests; this only bounds closing idle connections
        timeout_graceful_shutdown=5,
        log_config=None if settings.json_output else uvicorn.config.LOGGING_CONFIG,
    )
    server = DrainingServer(config)
    server.engine_died = False
    return server


def serve(settings: ServerSettings) -> int:
    """Load the model, then serve until interrupted (SIGTERM/SIGINT drain first).
    Returns the exit status: 1 when the server stopped because the engine died."""
    engine = build_engine(settings)
    app = create_app(engine, settings)
    service: GenerationService = app.state.service
    model = engine.model_info
    logger.info(
        "serving %s on backend %s (dtype %s); KV cache holds %d tokens (%d blocks of %d); "
        "prefix caching %s, chunked prefill %s; max input %d, max total %d tokens; %s; http://%s:%d%s/ "
        "(the playground: docs/playground.md)",
        service.info.model_id, model.backend_description, service.info.dtype, model.num_kv_cache_tokens,
        model.num_kv_blocks, model.block_size,
        "on" if model.is_prefix_caching else "off",
        "on" if model.is_chunked_prefill else "off",
        service.limits.max_input_tokens, service.limits.max_total_tokens,
        "API-key auth on" if settings.api_key is not None else "API-key auth off: every route is open",
        settings.hostname, settings.port, settings.root_path,
    )
    server = create_server(app, settings)
    server.run()
    return 1 if server.engine_died else 0
