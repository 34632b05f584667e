"""POST /v1/embeddings (OpenAI). Each input is one pooling request (`ember.api.pooling`):
prefilled beside the other requests, pooled as the model's pooling says (--pooling or
its sentence-transformers config; docs/embeddings.md), nothing generated. The answer
is OpenAI's: ``data[i].embedding`` as numbers, or with ``encoding_format: "base64"``
the little-endian float32 bytes base64-encoded (what the openai SDK asks for and decodes
by default)."""

from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, error_response, validation_error
from ember.api.http import read_model
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.routes.pooling import check_dimensions, run_pooled, tokenize_inputs
from ember.api.schemas import embeddings as em
from ember.api.schemas import openai as oa
from ember.api.service import GenerationService
from ember.pooling_params import PoolingParams


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # the float32 values' little-endian bytes (what the openai SDK decodes)
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def check_base_model(service: GenerationService, model: str | None) -> None:
    """Pooling runs on the base model: a LoRA adapter's name is refused (422 naming ``model``)."""
    if model is not None and service.adapter_for_model(model) is not None:
        raise validation_error(f"`model` {model!r} is a LoRA adapter; embeddings, rerank and score run on the "
                               f"base model {service.info.model_id!r} only", "model")


class EmbeddingRoutes:
    def __init__(self, service: GenerationService) -> None:
        self.service = service

    @documented(summary="Embeddings (OpenAI)", tag="OpenAI", request=em.EmbeddingRequest,
                response=em.EmbeddingResponse, error_model=oa.ErrorResponse, errors=GENERATION_ERRORS)
    async def embeddings(self, request: Request) -> Response:
        try:
            body = await read_model(request, em.EmbeddingRequest)
            check_base_model(self.service, body.model)
            check_dimensions(self.service, body.dimensions)
            jobs = await self.service.run_blocking(self._jobs, body)
            vectors = await run_pooled(self.service, request, jobs, PoolingParams(dimensions=body.dimensions))
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        if vectors is None:
            return Response(status_code=499)
        num_tokens = sum(len(job.prompt_ids) for job in jobs)
        response = em.EmbeddingResponse(
            data=[em.Embedding(index=i, embedding=encode_vector(v, body.encoding_format)) for i, v in enumerate(vectors)],
            model=self.service.info.model_id,
            usage=em.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    def _jobs(self, body: em.EmbeddingRequest):
        value = body.input
        is_batch = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
        return tokenize_inputs(self.service, value if is_batch else [value], "input", is_batch)

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"])]

