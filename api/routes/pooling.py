"""What the embeddings, rerank and score routes share (docs/embeddings.md): a request's
inputs checked and tokenized, and run as pooling requests.

Every input of one HTTP request is one engine request (scheduled like a prompt,
batched with whatever else runs, generating nothing). The HTTP request takes one slot of
--max-concurrent-requests whatever its number of inputs (up to `MAX_INPUTS`, OpenAI's
limit: LangChain sends 1,000 texts a call), and keeps at most `WINDOW` of them in the
engine at once, so a large batch streams through beside other clients' requests
instead of queueing ahead of all of them. Any causal LM
can embed (last-token pooling of its final hidden states): a generation model is not
refused, though only embedding models give embeddings worth comparing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from ember.api.errors import APIError, validation_error
from ember.api.http import ClientDisconnected, unless_disconnected
from ember.api.service import GenerationService
from ember.pooling_params import PoolingParams
from ember.sampling_params import SamplingParams

MAX_INPUTS = 2048  # inputs of one request (OpenAI's limit for /v1/embeddings)
WINDOW = 32  # inputs of one request in the engine at once


@dataclass(frozen=True, slots=True)
class PoolingJob:
    """One input of a request: its token ids, and the field a 4xx about it names."""

    prompt_ids: list[int]
    param: str


def tokenize_inputs(service: GenerationService, items: list, param: str, is_batch: bool) -> list[PoolingJob]:
    """Each input (a string, or token ids) checked and tokenized; a 422 names the first
    bad one (``input[2]``): empty, outside the vocabulary, longer than --max-input-tokens."""
    if not items:
        raise validation_error(f"`{param}` is empty: give at least one input", param)
    if len(items) > MAX_INPUTS:
        raise validation_error(f"`{param}` holds {len(items)} inputs; at most {MAX_INPUTS} per request", param)
    names = [f"{param}[{i}]" if is_batch else param for i in range(len(items))]
    vocab = service.model_info.vocab_size
    for item, name in zip(items, names):
        if isinstance(item, str):
            if not item:
                raise validation_error(f"`{name}` is an empty string: give a non-empty input", name)
            service.check_chars(item, name)
        elif not item:
            raise validation_error(f"`{name}` is empty: give at least one token id", name)
        else:
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise validation_error(f"`{name}` token id {bad} is outside the vocabulary [0, {vocab})", name)
    jobs = []
    for item, name in zip(items, names):
        ids = service.encode(item) if isinstance(item, str) else list(item)
        service.check_lengths(len(ids), 0, input_name=name)
        jobs.append(PoolingJob(ids, name))
    return jobs


def check_dimensions(service: GenerationService, dimensions: int | None) -> None:
    """400 naming ``dimensions`` unless the model supports truncated (Matryoshka) embeddings of that size."""
    if dimensions is None:
        return
    pooling = service.model_info.pooling
    if not pooling.is_matryoshka:
        raise APIError(400, "`dimensions`: this model does not support truncated (Matryoshka) embeddings; "
                       "remove the field (or start the server with --matryoshka for a model trained for it)",
                       "validation", "dimensions")
    if dimensions > pooling.hidden_size:
        raise APIError(400, f"`dimensions` must be at most the model's embedding size {pooling.hidden_size}, "
                       f"got {dimensions}", "validation", "dimensions")


async def run_pooled(
    service: GenerationService, request: Request, jobs: list[PoolingJob], pooling: PoolingParams,
) -> list[list[float]] | None:
    """Every job's vector, in order (at most `WINDOW` in the engine at once, which batches
    them); None if the client left (its requests are then aborted). One
    --max-concurrent-requests slot for them all."""
    params = SamplingParams.for_pooling(pooling)
    for job in jobs:
        service.validate(job.prompt_ids, params)
    window = asyncio.Semaphore(WINDOW)
    with service.admit():

        async def one(job: PoolingJob) -> list[float]:
            async with window:
                last = None
                async for last in service.generate(None, job.prompt_ids, params):
                    pass
                return last.pooled

        tasks = [asyncio.ensure_future(one(job)) for job in jobs]
        try:
            return await unless_disconnected(request, asyncio.gather(*tasks))
        except ClientDisconnected:
            return None
        finally:
            for task in tasks:  # one failed (or the client left): the others are aborted
                task.cancel()
