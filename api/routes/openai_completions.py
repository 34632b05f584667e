"""POST /v1/completions (OpenAI). A list prompt runs as one engine request per prompt,
all concurrently, and takes one slot of --max-concurrent-requests per prompt: a list
of 8 prompts weighs on the server like 8 clients, and is refused (429) as a whole
when that many slots are not free. The plumbing it shares with /v1/chat/completions
is `ember.api.routes.openai`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import (
    APIError,
    Flavor,
    error_response,
    not_available,
    validation_error,
)
from ember.api.http import read_model
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.routes.openai import (
    DONE_EVENT,
    Job,
    OpenAIRoutes,
    Pending,
    Reply,
    check_not_yet,
    finish_reason,
    per_choice,
    usage,
)
from ember.api.schemas import openai as oa
from ember.api.service import GenerationService
from ember.api.structured_outputs import check_backend, failure, openai_constraint
from ember.outputs import RequestOutput


def completion_logprobs(service: GenerationService, out: RequestOutput, start: int, offset: int) -> oa.CompletionLogprobs:
    """The completions API's parallel lists for generated tokens ``start ...``; text
    offsets count from ``offset`` (the length of the text before them)."""
    completion = out.outputs[0]
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for logprobs, token_id in zip(completion.logprobs[start:], completion.token_ids[start:]):
        text = service.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprobs[token_id].logprob)
        by_text: dict[str, float] = {}
        for t, lp in logprobs.items():  # the chosen token first; texts may collide (U+FFFD)
            by_text.setdefault(service.token_text(t), lp.logprob)
        top.append(by_text)
        text_offset.append(offset)
        offset += len(text)
    return oa.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=text_offset)




class CompletionRoutes(OpenAIRoutes):
    @documented(summary="Completions (OpenAI)", tag="OpenAI", request=oa.CompletionRequest,
                response=oa.CompletionResponse, streams=True, error_model=oa.ErrorResponse,
                errors=GENERATION_ERRORS)
    async def completions(self, request: Request) -> Response:
        try:
            body = await read_model(request, oa.CompletionRequest)
            jobs = await self.service.run_blocking(self._completion_jobs, body)
            reply = self._reply("cmpl", "text_completion", body)
            if body.stream:
                return await self._stream(lambda outs: self._completion_events(reply, jobs, outs), jobs)
            outs = await self._run(request, jobs)
            if outs is not None and jobs[0].params.constraint is not None:
                self._check_failures(outs, jobs)
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        if outs is None:
            return Response(status_code=499)
        response = oa.CompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, system_fingerprint=reply.system_fingerprint,
            choices=[
                oa.CompletionChoice(
                    index=index, text=job.echo + out.outputs[0].text, finish_reason=finish_reason(out),
                    logprobs=None if body.logprobs is None else completion_logprobs(self.service, out, 0, len(job.echo)),
                )
                for index, (job, out) in enumerate(zip(per_choice(jobs), outs))
            ],
            usage=usage(jobs, outs),
        )
        return JSONResponse(response.model_dump())

    def _completion_jobs(self, body: oa.CompletionRequest) -> list[Job]:
        adapter = self.service.adapter_for_model(body.model)
        check_not_yet(body)
        if body.suffix:
            raise not_available("suffix", "issue 4 (suffix)")
        self._check_stop(body)
        prompts = self._prompts(body.prompt)
        if len(prompts) > self.service.limits.max_concurrent_requests:
            raise validation_error(
                f"`prompt` holds {len(prompts)} prompts; at most --max-concurrent-requests "
                f"({self.service.limits.max_concurrent_requests}) can run at once", "prompt",
            )
        constraint, param = None, None
        if body.has_structured_output:
            constraint, param = openai_constraint(body)
            check_backend(self.service.client, constraint, body.guided_decoding_backend, "guided_decoding_backend")
        jobs = []
        for index, (text, ids, name) in enumerate(prompts):
            max_tokens = self._max_tokens(len(ids), body.max_tokens, name, "max_tokens")
            params = self._params(body, max_tokens, constraint)
            self.service.validate(ids, params)
            echo = "" if not body.echo else text if text is not None else self.service.client.decode(ids)
            jobs.append(Job(index, text, ids, params, echo, body.priority, param, adapter))
        return jobs

    def _prompts(self, prompt: str | list) -> list[tuple[str | None, list[int], str]]:
        """(text, token ids, name for errors) of each prompt; every prompt's cheap
        checks pass before any is tokenized."""
        is_batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        items = prompt if is_batch else [prompt]
        names = [f"prompt[{i}]" if is_batch else "prompt" for i in range(len(items))]
        vocab = self.service.model_info.vocab_size
        for item, name in zip(items, names):
            if not item:
                raise validation_error(f"`{name}` is empty: give a non-empty prompt", name)
            if isinstance(item, str):
                self.service.check_chars(item, name)
                continue
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise validation_error(f"`{name}` token id {bad} is outside the vocabulary [0, {vocab})", name)
        return [
            (item, self.service.encode(item), name) if isinstance(item, str) else (None, list(item), name)
            for item, name in zip(items, names)
        ]

    async def _completion_events(self, reply: Reply, jobs: list[Job], outputs: AsyncIterator) -> AsyncIterator[bytes]:
        choice_jobs = per_choice(jobs)  # streaming has no best_of > n: choices are samples
        for index, job in enumerate(choice_jobs):
            if job.echo:
                yield reply.chunk([{"index": index, "text": job.echo, "logprobs": None, "finish_reason": None}])
        num_tokens = 0  # every choice's generated tokens, for usage
        offsets = [len(job.echo) for job in choice_jobs]
        pending = [Pending() for _ in choice_jobs]  # tokens whose logprobs are not sent yet
        async with aclosing(outputs) as outs:
            async for index, out in outs:
                error = failure(out, jobs[0].constraint_param) if out.outputs[0].finish_reason == "error" else None
                if error is not None:
                    raise error
                num_tokens += len(out.new_token_ids)
                pending[index].add(out)
                if out.new_text or out.finished:
                    reason = finish_reason(out) if out.finished else None
                    logprobs = None
                    if choice_jobs[index].params.logprobs is not None:
                        lp = completion_logprobs(self.service, pending[index].take(out), 0, offsets[index])
                        offsets[index] += sum(len(t) for t in lp.tokens)
                        logprobs = lp.model_dump()
                    yield reply.chunk([{"index": index, "text": out.new_text, "logprobs": logprobs, "finish_reason": reason}])
        if reply.include_usage:
            yield reply.chunk([], usage(jobs, num_completion=num_tokens).model_dump())
        yield DONE_EVENT

    # -- /v1/chat/completions -------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"])]
