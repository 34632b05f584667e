"""Routes every client shares: health, info, models list."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.openapi import documented
from ember.api.schemas import tgi
from ember.api.service import GenerationService, Lifecycle
from ember.sampling_params import MAX_PARALLEL_SAMPLES


class CommonRoutes:
    def __init__(self, service: GenerationService, lifecycle: Lifecycle | None = None) -> None:
        self.service = service
        self.lifecycle = lifecycle

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/info", self.info, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ]

    @documented(summary="Health: 200 once warmed up and while serving, 503 otherwise", tag="Common")
    async def health(self, request: Request) -> Response:
        """200 while the engine loop runs and the server is ready (warmed up, not draining);
        503 with the reason otherwise."""
        engine = self.service.client
        lifecycle = self.lifecycle
        if (cause := getattr(engine, "restart_cause", None)) is not None:  # --restart-engine-on-failure: a new core is loading
            message, error_type = f"the engine core is restarting after it died ({cause})", "unhealthy"
        elif not engine.is_running:
            message, error_type = f"engine is not running: {engine.dead_error!r}", "unhealthy"
        elif lifecycle is None or lifecycle.is_ready:
            return JSONResponse({"status": "ok"})
        elif lifecycle.is_draining:
            message, error_type = "the server is shutting down", "shutting_down"
        elif lifecycle.warm_up_error is not None:
            message, error_type = f"warm-up failed: {lifecycle.warm_up_error!r}", "unhealthy"
        else:
            message, error_type = "warming up: the model is loaded, its first forward pass has not run yet", "starting"
        return JSONResponse({"error": message, "error_type": error_type}, status_code=503)

    @documented(summary="Model, dtype, backend, limits and version", tag="Common", response=tgi.Info)
    async def info(self, request: Request) -> Response:
        s = self.service
        model, stats, limits = s.model_info, s.client.stats(), s.limits
        return JSONResponse(
            {
                "model_id": s.info.model_id,
                "model_sha": None,
                "model_dtype": s.info.dtype,
                "model_device_type": s.info.backend,
                "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": limits.max_concurrent_requests,
                "max_best_of": MAX_PARALLEL_SAMPLES,
                "max_stop_sequences": limits.max_stop_sequences,
                "max_input_tokens": limits.max_input_tokens,
                "max_total_tokens": limits.max_total_tokens,
                "max_batch_prefill_tokens": limits.max_batch_prefill_tokens,
                "max_batch_total_tokens": limits.max_batch_total_tokens,
                "max_client_batch_size": 1,
                "router": "ember",
                "version": s.info.version,
                "backend": s.info.backend,
                "num_kv_blocks": model.num_kv_blocks,
                "kv_cache_tokens": model.num_kv_cache_tokens,
                "prefix_caching": model.is_prefix_caching,
                "prefix_cache_hit_rate": stats.prefix_hit_rate,
                "num_preemptions": stats.num_preemptions,
                "max_batch_size": model.max_num_seqs,
                "num_threads": model.num_threads,
                "chunked_prefill": model.is_chunked_prefill,
                "kv_block_size": model.block_size,
                # speculative decoding: method, proposed/accepted/emitted tokens, rates (None when off)
                "speculation": stats.speculation,
            }
        )

    @documented(summary="The served model and its LoRA adapters (OpenAI list shape, vLLM's fields)", tag="OpenAI")
    async def models(self, request: Request) -> Response:
        """The base model first, then each loaded adapter with the base as its ``parent``
        (or the base_model_name --lora-modules gave it) and its path as ``root``."""
        s = self.service
        base = {
            "id": s.info.model_id, "object": "model", "created": s.info.created, "owned_by": "ember",
            "root": s.model_info.model or s.model_info.model_dir, "parent": None,
            "max_model_len": s.limits.max_total_tokens,
        }
        adapters = [
            {"id": name, "object": "model", "created": s.info.created, "owned_by": "ember", "root": adapter.path,
             "parent": s.adapter_parents.get(name, s.info.model_id)}
            for name, adapter in s.client.adapters().items()
        ]
        return JSONResponse({"object": "list", "data": [base, *adapters]})
