"""POST /v1/rerank and /rerank (Jina's and Cohere's shape) and POST /v1/score (vLLM's).

Two ways to score a (query, document) pair (docs/embeddings.md):

* without --score-template: the cosine similarity of their embeddings (each text one
  pooling request, normalised; an embedding model's way);
* with --score-template: one pooling request per pair, the template's prompt with the
  query and the document in it, pooled as the next-token logits of the two
  --score-tokens (``PoolingParams("logits")``); the score is P(yes) / (P(yes) + P(no)),
  as Qwen3-Reranker scores.
"""

from __future__ import annotations

import time
import uuid

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, error_response, validation_error
from ember.api.http import read_model
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.pooling import ScoreTemplate
from ember.api.routes.openai_embeddings import check_base_model
from ember.api.routes.pooling import PoolingJob, run_pooled, tokenize_inputs
from ember.api.schemas import openai as oa
from ember.api.schemas import rerank as rr
from ember.api.service import GenerationService
from ember.pooling_params import PoolingParams


class RerankRoutes:
    def __init__(self, service: GenerationService, template: ScoreTemplate | None = None) -> None:
        self.service = service
        self.template = template

    @documented(summary="Rerank documents against a query (Jina / Cohere)", tag="Rerank", request=rr.RerankRequest,
                response=rr.RerankResponse, error_model=oa.ErrorResponse, errors=GENERATION_ERRORS)
    async def rerank(self, request: Request) -> Response:
        try:
            body = await read_model(request, rr.RerankRequest)
            check_base_model(self.service, body.model)
            texts = [d if isinstance(d, str) else d.text for d in body.documents]
            if not texts:
                raise validation_error("`documents` is empty: give at least one document", "documents")
            scored = await self._scores(request, [body.query] * len(texts), texts, "query", "documents")
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n]
        response = rr.RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=self.service.info.model_id,
            results=[rr.RerankResult(index=i, relevance_score=scores[i],
                                     document=rr.RerankDocument(text=texts[i]) if body.return_documents else None)
                     for i in order],
            usage=rr.RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    @documented(summary="Score text pairs (vLLM)", tag="Rerank", request=rr.ScoreRequest, response=rr.ScoreResponse,
                error_model=oa.ErrorResponse, errors=GENERATION_ERRORS)
    async def score(self, request: Request) -> Response:
        try:
            body = await read_model(request, rr.ScoreRequest)
            check_base_model(self.service, body.model)
            firsts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
            seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
            if not firsts:
                raise validation_error("`text_1` is empty: give at least one text", "text_1")
            if not seconds:
                raise validation_error("`text_2` is empty: give at least one text", "text_2")
            if len(firsts) == 1:
                firsts = firsts * len(seconds)  # 1:N
            elif len(firsts) != len(seconds):
                raise validation_error(f"`text_1` has {len(firsts)} texts and `text_2` {len(seconds)}: give one "
                                       "text_1, or as many as text_2 (pairs)", "text_2")
            scored = await self._scores(request, firsts, seconds, "text_1", "text_2")
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        response = rr.ScoreResponse(
            id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=self.service.info.model_id,
            data=[rr.ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=rr.RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    async def _scores(
        self, request: Request, queries: list[str], documents: list[str], query_param: str, document_param: str,
    ) -> tuple[list[float], int] | None:
        """The score of each (queries[i], documents[i]) and the prompt tokens computed; None if the client left."""
        if self.template is not None:
            template = self.template
            prompts = [template.prompt(q, d) for q, d in zip(queries, documents)]
            jobs = await self.service.run_blocking(tokenize_inputs, self.service, prompts, document_param, True)
            pooling = PoolingParams("logits", logit_token_ids=(template.yes_token_id, template.no_token_id))
            logits = await run_pooled(self.service, request, jobs, pooling)
            if logits is None:
                return None
            # P(yes) / (P(yes) + P(no)): a softmax over the two logits
            scores = [float(torch.softmax(torch.tensor(pair), dim=0)[0]) for pair in logits]
            return scores, sum(len(job.prompt_ids) for job in jobs)
        distinct = list(dict.fromkeys(queries))  # the query once, not once per document
        query_jobs = await self.service.run_blocking(tokenize_inputs, self.service, distinct, query_param,
                                                     len(distinct) > 1)
        document_jobs = await self.service.run_blocking(tokenize_inputs, self.service, documents, document_param, True)
        jobs: list[PoolingJob] = query_jobs + document_jobs
        if len(jobs) > self.service.limits.max_concurrent_requests:
            raise validation_error(
                f"`{document_param}` and `{query_param}` hold {len(jobs)} texts; at most --max-concurrent-requests "
                f"({self.service.limits.max_concurrent_requests}) can run at once", document_param,
            )
        vectors = await run_pooled(self.service, request, jobs, PoolingParams(normalize=True))
        if vectors is None:
            return None
        matrix = torch.tensor(vectors)  # normalised rows: a dot product is the cosine
        by_query = dict(zip(distinct, matrix[: len(distinct)]))
        scores = [float(by_query[q] @ d) for q, d in zip(queries, matrix[len(distinct):])]
        return scores, sum(len(job.prompt_ids) for job in jobs)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/rerank", self.rerank, methods=["POST"]),
            Route("/rerank", self.rerank, methods=["POST"]),
            Route("/v1/score", self.score, methods=["POST"]),
        ]
