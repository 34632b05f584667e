"""The Starlette application and `ember serve`.

The engine runs in its own thread (`AsyncLLMEngine`); the event loop only parses,
validates, queues and streams, so /health answers while a batch computes.
"""

from __future__ import annotations

import contextlib
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from ember.api.errors import APIError, Flavor, error_response
from ember.api.routes.common import CommonRoutes
from ember.api.routes.tgi import TGIRoutes
from ember.api.service import GenerationService, ModelInfo
from ember.api.settings import ServerSettings, engine_config_kwargs, resolve_limits
from ember.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)


def _flavor(request: Request) -> Flavor:
    return Flavor.OPENAI if request.url.path.startswith("/v1/") else Flavor.TGI


async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    error_type = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(APIError(exc.status_code, message, error_type), _flavor(request))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, f"internal error: {exc!r}", "internal"), _flavor(request))


def plugin_routes(plugin_manager, service: GenerationService, taken: set[str]) -> list:
    """The routes plugins add through ``ember_api_routes``, once, at app creation."""
    added = []
    for plugin_list in plugin_manager.hook.ember_api_routes(service=service):
        for route in plugin_list or ():
            if route.path in taken:
                raise ValueError(f"a plugin's route {route.path!r} clashes with a route the app already has")
            taken.add(route.path)
            added.append(route)
    return added


def create_app(engine: AsyncLLMEngine, settings: ServerSettings) -> Starlette:
    """Build the app around a started or startable engine (started on app startup)."""
    import ember

    core = engine.engine
    limits = resolve_limits(settings, core.max_model_len, core.num_kv_cache_tokens)
    model_id = settings.served_model_name or settings.model_id or core.config.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
    info = ModelInfo(
        model_id=model_id,
        dtype=str(core.dtype).removeprefix("torch."),
        backend=core.backend.name,
        version=ember.__version__,
        created=int(time.time()),
    )
    service = GenerationService(engine, limits, info)
    routes = CommonRoutes(service).routes() + TGIRoutes(service).routes()
    try:
        from ember.api.routes.openai import OpenAIRoutes
    except ImportError:  # pragma: no cover - during development only
        OpenAIRoutes = None
    if OpenAIRoutes is not None:
        routes += OpenAIRoutes(service).routes()
    routes += plugin_routes(core.plugin_manager, service, {route.path for route in routes})
    from ember.api.openapi import OpenAPIRoutes

    routes += OpenAPIRoutes(routes).routes()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.service = service
    return app


def build_engine(settings: ServerSettings) -> AsyncLLMEngine:
    from ember.config import EngineConfig
    from ember.engine import LLMEngine

    core = LLMEngine(EngineConfig(**engine_config_kwargs(settings)))
    return AsyncLLMEngine(core)


def serve(settings: ServerSettings) -> None:
    """Load the model, then serve until interrupted."""
    import uvicorn

    engine = build_engine(settings)
    app = create_app(engine, settings)
    service: GenerationService = app.state.service
    core = engine.engine
    logger.info(
        "serving %s on backend %s (dtype %s); KV cache holds %d tokens (%d blocks of %d); "
        "prefix caching %s, chunked prefill %s; max input %d, max total %d tokens; http://%s:%d",
        service.info.model_id, core.backend.describe(), service.info.dtype, core.num_kv_cache_tokens,
        core.kv_manager.num_blocks, core.kv_manager.block_size,
        "on" if core.kv_manager.enable_prefix_caching else "off",
        "on" if core.scheduler.config.enable_chunked_prefill else "off",
        service.limits.max_input_tokens, service.limits.max_total_tokens, settings.hostname, settings.port,
    )
    uvicorn.run(app, host=settings.hostname, port=settings.port, log_level="warning", timeout_graceful_shutdown=5)
