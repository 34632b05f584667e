"""LoRA adapters at run time (docs/lora.md): vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, and the per-adapter metrics.

The two routes answer only with --enable-lora-runtime-updates (vLLM gates them behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING): otherwise 404 saying how to turn them on; with
adapters off altogether, 400 naming --enable-lora. Like every API route they need the
API key. Success is vLLM's plain-text line; failures are OpenAI-shaped JSON: 400 for an
adapter that cannot serve (`AdapterError`: a bad path, damaged files, a rank above
--max-lora-rank, a module or shape the model does not have, a name already loaded),
404 for unloading a name that is not loaded, 422 for a malformed body. Loading reads
the files off the event loop; loads and unloads run one at a time.

Which adapter a request runs under is `GenerationService.adapter_for_model` (OpenAI's
``model``) and `adapter_for_id` (TGI's ``adapter_id``).

Metrics: ``ember_lora_requests_info`` (vLLM's ``lora_requests_info``: adapters running
and waiting, --max-loras, as labels; the value is the time read), and per adapter
``ember_lora_requests_total`` and ``ember_lora_generation_tokens_total`` (base-model
requests are not counted there).
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, bad_request, error_response
from ember.api.http import read_model
from ember.api.observability import RequestContext, ServerMetrics
from ember.api.openapi import documented
from ember.api.schemas import openai as oa
from ember.api.service import GenerationService
from ember.engine.client import EngineClient
from ember.plugin.adapter import AdapterError, UnknownAdapterError

logger = logging.getLogger("ember.api.lora")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ERRORS = (400, 401, 404, 408, 413, 415, 422)


class LoRARoutes:
    def __init__(self, service: GenerationService, runtime_updates: bool) -> None:
        self.service = service
        self.runtime_updates = runtime_updates
        self._lock = asyncio.Lock()  # one load or unload at a time: no name loaded twice by a race

    def routes(self) -> list[Route]:
        return [
            Route(LOAD_PATH, self.load, methods=["POST"]),
            Route(UNLOAD_PATH, self.unload, methods=["POST"]),
        ]

    def _check_enabled(self, path: str) -> None:
        if not self.runtime_updates:
            raise APIError(404, f"POST {path} is off: start the server with --enable-lora-runtime-updates "
                           "(EMBER_ENABLE_LORA_RUNTIME_UPDATES=1) to load and unload LoRA adapters at run time",
                           "lora_runtime_updates_off")
        if not self.service.lora_enabled:
            raise bad_request("LoRA adapters are off: start the server with --enable-lora (or --lora-modules "
                              "NAME=PATH) to serve adapters")

    @documented(summary="Load a LoRA adapter (vLLM; needs --enable-lora-runtime-updates)", tag="LoRA",
                request=oa.LoadLoRAAdapterRequest, text_media_type="text/plain", errors=ERRORS,
                error_model=oa.ErrorResponse)
    async def load(self, request: Request) -> Response:
        try:
            self._check_enabled(LOAD_PATH)
            body = await read_model(request, oa.LoadLoRAAdapterRequest)
            name = body.lora_name
            if name == self.service.info.model_id:
                raise bad_request(f"adapter name {name!r} is the served model's name; choose another", "lora_name")
            async with self._lock:
                started = time.perf_counter()
                try:
                    info = await self.service.run_blocking(self.service.client.load_adapter, name, body.lora_path)
                except AdapterError as exc:
                    raise APIError(400, str(exc), "invalid_adapter") from None
                self.service.adapter_parents.pop(name, None)
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        logger.info("loaded LoRA adapter %r (%s, rank %d) from %s in %.2f s", name, info.kind, info.rank,
                    body.lora_path, time.perf_counter() - started)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @documented(summary="Unload a LoRA adapter (vLLM; needs --enable-lora-runtime-updates)", tag="LoRA",
                request=oa.UnloadLoRAAdapterRequest, text_media_type="text/plain", errors=ERRORS,
                error_model=oa.ErrorResponse)
    async def unload(self, request: Request) -> Response:
        try:
            self._check_enabled(UNLOAD_PATH)
            body = await read_model(request, oa.UnloadLoRAAdapterRequest)
            name = body.lora_name
            async with self._lock:
                try:
                    self.service.client.unload_adapter(name)
                except UnknownAdapterError as exc:
                    raise APIError(404, str(exc), "adapter_not_found", "lora_name") from None
                except AdapterError as exc:
                    raise APIError(400, str(exc), "invalid_adapter", "lora_name") from None
                self.service.adapter_parents.pop(name, None)
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        logger.info("unloaded LoRA adapter %r (its running requests finish)", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


class LoRAMetrics(Collector):
    """The adapter metrics of one app (registered only when adapters are on)."""

    def __init__(self, client: EngineClient, metrics: ServerMetrics) -> None:
        self.client = client
        r = metrics.registry
        self.requests = Counter(
            "ember_lora_requests", "Engine requests under a LoRA adapter, counted as each ends (finished, aborted "
            "or failed), by adapter name; base-model requests are not counted", ["adapter"], registry=r,
        )
        self.generation_tokens = Counter(
            "ember_lora_generation_tokens", "Tokens generated under a LoRA adapter (every sample's, aborted "
            "requests' too), by adapter name; base-model tokens are not counted", ["adapter"], registry=r,
        )
        r.register(self)
        metrics.request_observers.append(self.observe_request)

    def observe_request(self, ctx: RequestContext) -> None:
        for g in ctx.generations:
            if g.adapter is not None:
                self.requests.labels(g.adapter).inc()
                self.generation_tokens.labels(g.adapter).inc(g.num_generated_tokens)

    def describe(self):
        return []  # not known before collect (auto_describe would collect at registration)

    def collect(self):
        lora, stats = self.client.model_info.lora, self.client.stats()
        if lora is None:
            return
        family = GaugeMetricFamily(
            "ember_lora_requests_info", "LoRA adapters with requests running and waiting now (comma-separated "
            "names) and --max-loras, as labels; the value is the time they were read (Unix seconds)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        family.add_metric([",".join(stats.running_adapters), ",".join(stats.waiting_adapters), str(lora.max_loras)],
                          time.time())
        yield family
