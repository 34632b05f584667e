"""OpenAI routes: /v1/completions and /v1/chat/completions.

One model is served, so `model` is echoed back whatever it names (as TGI does).
A list prompt in /v1/completions runs as one engine request per prompt, all
concurrently, and takes one slot of --max-concurrent-requests per prompt: a list
of 8 prompts weighs on the server like 8 clients, and is refused (429) as a whole
when that many slots are not free.

A constrained request (structured outputs, a forced tool call) waits for its first
engine output before answering, streams included, so that a grammar that fails to
compile is a 400 (`ember.api.structured_outputs`). On chat, a tool-call parser
(`ember.engine.tool_calls`) reads the answer into `tool_calls`, streamed as OpenAI does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import (
    APIError,
    Flavor,
    bad_request,
    error_response,
    not_available,
    sse_error_event,
    validation_error,
)
from ember.api.http import ClientDisconnected, EventStreamResponse, read_model, sse_event, unless_disconnected
from ember.api.openapi import documented
from ember.api.schemas import openai as oa
from ember.api.service import GenerationService, with_watermark
from ember.api.structured_outputs import check_backend, failure, openai_constraint
from ember.engine.tool_calls import NO_TOOLS, ToolSetup, chat_messages, setup_tools
from ember.outputs import OutputKind, RequestOutput
from ember.plugin.grammar import Constraint
from ember.plugin.tool_parser import BaseToolParser, ParserDelta
from ember.sampling_params import SamplingParams

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class _Job:
    """One engine request behind one choice of the answer."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # text put before the generated text (`echo`)
    priority: int = 0
    constraint_param: str | None = None  # the field its constraint came from (named by a 400)


@dataclass(frozen=True, slots=True)
class _Reply:
    """What every object of one answer shares."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    include_usage: bool

    def chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {
            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "system_fingerprint": self.system_fingerprint, "choices": choices,
        }
        if self.include_usage:
            payload["usage"] = usage
        return sse_event(payload)


def choice_view(out: RequestOutput) -> RequestOutput:
    """One sample of a (possibly n > 1) output as a one-completion output, finished
    when that sample is: what the rest of this module works on."""
    completion = next(c for c in out.outputs if c.index == out.index)
    return replace(out, outputs=[replace(completion, index=0)], finished=completion.finish_reason is not None)


class _Pending:
    """A streamed choice's tokens (and logprobs) not reported yet: a step whose text is
    held back (a possible stop string, an incomplete character) reports its tokens'
    logprobs with the next chunk that has text, or the last one."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list = []

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.outputs[0].token_ids)
        self.logprobs.extend(out.outputs[0].logprobs or ())

    def take(self, out: RequestOutput) -> RequestOutput:
        """``out`` holding every pending token (and emptying the pending lists)."""
        view = replace(out, outputs=[replace(out.outputs[0], token_ids=self.token_ids, logprobs=self.logprobs)])
        self.token_ids, self.logprobs = [], []
        return view


def per_choice(jobs: list[_Job]) -> list[_Job]:
    """The job behind each returned choice, in choice order."""
    return [job for job in jobs for _ in range(job.params.n)]


def finish_reason(out: RequestOutput, has_tool_calls: bool = False) -> str:
    if out.outputs[0].finish_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def tool_call_pieces(delta: ParserDelta, max_calls: int | None) -> list[dict]:
    """A parser's call pieces as OpenAI's `delta.tool_calls` entries."""
    pieces = []
    for piece in delta.tool_calls:
        if max_calls is not None and piece.index >= max_calls:
            continue
        function = {"arguments": piece.arguments}
        entry: dict = {"index": piece.index, "function": function}
        if piece.id is not None:
            entry.update(id=piece.id, type="function")
            function["name"] = piece.name
        pieces.append(entry)
    return pieces


def assistant_message(text: str, setup: ToolSetup) -> tuple[oa.AssistantMessage, bool]:
    """The answer as a message (its tool calls read by the chat's parser), and whether
    it holds calls."""
    if setup.parser is None:
        return oa.AssistantMessage(content=text), False
    parsed = setup.parser().parse(text)
    calls = parsed.tool_calls[: setup.max_calls]
    if not calls:
        return oa.AssistantMessage(content=text), False
    return oa.AssistantMessage(content=parsed.content, tool_calls=[
        oa.ToolCall(id=call.id, function=oa.FunctionCall(name=call.name, arguments=call.arguments)) for call in calls
    ]), True


def usage(jobs: list[_Job], outs: list[RequestOutput] | None = None, num_completion: int = 0) -> oa.Usage:
    """Prompts count once each (whatever n is); every returned choice's tokens count
    (those of ``outs``' cumulative outputs, else ``num_completion``)."""
    num_prompt = sum(len(job.prompt_ids) for job in jobs)
    if outs is not None:
        num_completion = sum(len(out.outputs[0].token_ids) for out in outs)
    return oa.Usage(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion)


def chat_logprobs(service: GenerationService, out: RequestOutput, start: int, num_top: int) -> oa.ChatLogprobs:
    """`choices[].logprobs` of the chat API for generated tokens ``start ...``."""
    content = []
    for logprobs, token_id in zip(out.outputs[0].logprobs[start:], out.outputs[0].token_ids[start:]):
        ranked = sorted((lp.rank, t) for t, lp in logprobs.items() if lp.rank <= num_top)
        top = [_top_logprob(service, t, logprobs[t].logprob) for _, t in ranked]
        chosen = _top_logprob(service, token_id, logprobs[token_id].logprob)
        content.append(oa.TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return oa.ChatLogprobs(content=content)


def _top_logprob(service: GenerationService, token_id: int, logprob: float) -> oa.TopLogprob:
    text = service.token_text(token_id)
    return oa.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


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


def check_not_yet(body: oa.SamplingFields) -> None:
    """Fields accepted only at their neutral value until the issue that implements them."""
    best_of = getattr(body, "best_of", None)
    if body.stream and best_of is not None and best_of > body.n:
        raise validation_error("`best_of` greater than `n` cannot be streamed", "best_of")
    if body.stream_options is not None and not body.stream:
        raise validation_error("`stream_options` is only allowed with `stream: true`", "stream_options")


class OpenAIRoutes:
    def __init__(self, service: GenerationService) -> None:
        self.service = service
        self.system_fingerprint = f"ember-{service.info.version}-{service.info.backend}"

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    # -- shared -----------------------------------------------------------------------
    def _params(self, body: oa.SamplingFields, max_tokens: int, constraint: Constraint | None = None) -> SamplingParams:
        seed = body.seed
        if seed is not None and seed < 0:
            seed += 2**64  # OpenAI seeds are signed 64-bit; same bits, same stream
        logit_bias = {int(key): bias for key, bias in (body.logit_bias or {}).items()}
        vocab = self.service.model_info.vocab_size
        bad = next((t for t in logit_bias if t >= vocab), None)
        if bad is not None:
            raise validation_error(f"`logit_bias` token id {bad} is outside the vocabulary [0, {vocab})", "logit_bias")
        try:
            return SamplingParams(
                temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, seed=seed,
                stop=tuple(body.stop_list),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=logit_bias,
                top_k=body.top_k if body.top_k is not None else -1,
                min_p=body.min_p or 0.0,
                repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
                extra=with_watermark(body.extra, body.watermark),
                logprobs=self._num_logprobs(body),
                n=body.n,
                best_of=getattr(body, "best_of", None),
                min_tokens=body.min_tokens or 0,
                bad_words_token_ids=self._bad_words(body.bad_words or []),
                stop_token_ids=tuple(self._checked_ids(body.stop_token_ids or [], "stop_token_ids")),
                ignore_eos=bool(body.ignore_eos),
                constraint=constraint,
                grammar_backend=body.guided_decoding_backend,
            )
        except ValueError as exc:
            raise validation_error(str(exc)) from None

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's rule: each word banned as tokenized alone and after a space."""
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            if not word:
                raise validation_error("`bad_words` must hold non-empty strings", "bad_words")
            for variant in (word, " " + word.lstrip()):
                ids = tuple(self.service.encode(variant, add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        return tuple(seqs)

    def _checked_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.service.model_info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise validation_error(f"`{param}` token id {bad} is outside the vocabulary [0, {vocab})", param)
        return ids

    @staticmethod
    def _num_logprobs(body: oa.SamplingFields) -> int | None:
        if isinstance(body, oa.ChatCompletionRequest):
            return (body.top_logprobs or 0) if body.logprobs else None
        return getattr(body, "logprobs", None)

    def _check_stop(self, body: oa.SamplingFields) -> None:
        stop = body.stop_list
        self.service.check_stop(stop, "stop")
        if any(not text for text in stop):
            raise validation_error("`stop` strings must be non-empty", "stop")

    def _max_tokens(self, num_input: int, requested: int | None, input_name: str, param: str) -> int:
        """The prompt's limits (TGI's), then `requested` against the room it leaves."""
        room = self.service.check_lengths(num_input, None, input_name=input_name)
        if requested is None:
            return room
        if requested > room:
            total = self.service.limits.max_total_tokens
            raise validation_error(
                f"`{input_name}` tokens + `{param}` must be <= {total}. "
                f"Given: {num_input} `{input_name}` tokens and {requested} `{param}`",
                param,
            )
        return requested

    def _admit(self, num_jobs: int) -> None:
        """Take one slot per job, or none (429)."""
        taken = 0
        try:
            for _ in range(num_jobs):
                self.service.acquire()
                taken += 1
        except APIError:
            self._release(taken)
            raise

    def _release(self, num_jobs: int) -> None:
        for _ in range(num_jobs):
            self.service.release()

    def _reply(self, prefix: str, object_name: str, body: oa.SamplingFields) -> _Reply:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _Reply(f"{prefix}-{uuid.uuid4().hex}", object_name, int(time.time()), body.model,
                      self.system_fingerprint, include_usage)

    async def _outputs(
        self, jobs: list[_Job], kind: OutputKind = OutputKind.CUMULATIVE
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs as they come, tagged with the choice's index: sample
        ``i`` of job ``j`` is choice ``j * num_samples + i`` (OpenAI's order for n > 1).
        Each is a one-completion view, finished when that sample is (with DELTA
        ``kind``, holding only what the step added). Closing this iterator (or an error
        in one job) cancels the others, which aborts them."""
        if len(jobs) == 1 and jobs[0].params.num_samples == 1:
            # one prompt, one sample (the usual chat request): no task or queue between
            # the engine's stream and the response
            job = jobs[0]
            async with aclosing(
                self.service.generate(job.prompt, job.prompt_ids, job.params, job.priority, kind)
            ) as outs:
                async for out in outs:
                    yield job.index, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

        async def pump(job: _Job) -> None:
            k = job.params.num_samples
            try:
                async with aclosing(
                    self.service.generate(job.prompt, job.prompt_ids, job.params, job.priority, kind)
                ) as outs:
                    async for out in outs:
                        queue.put_nowait((job.index * k + out.index, choice_view(out)))
            except Exception as exc:
                queue.put_nowait((job.index * k, exc))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            num_running = sum(job.params.num_samples for job in jobs)
            while num_running:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield index, item
                if item.finished:
                    num_running -= 1
        finally:
            for task in tasks:
                task.cancel()

    async def _final_outputs(self, jobs: list[_Job]) -> list[RequestOutput]:
        """One finished view per returned choice, in choice order: each job's final
        output holds its n completions (the n best of best_of, chosen by the engine)."""

        async def final(job: _Job) -> RequestOutput:
            last = None
            async with aclosing(self.service.generate(job.prompt, job.prompt_ids, job.params, job.priority)) as outs:
                async for last in outs:
                    pass
            return last

        tasks = [asyncio.ensure_future(final(job)) for job in jobs]
        try:
            finals = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one failed (or the client left): the others are aborted
                task.cancel()
        return [replace(out, outputs=[replace(c, index=0)]) for out in finals for c in out.outputs]

    async def _run(self, request: Request, jobs: list[_Job]) -> list[RequestOutput] | None:
        """Run to the end; None if the client left (its requests are then aborted)."""
        self._admit(len(jobs))
        try:
            return await unless_disconnected(request, self._final_outputs(jobs))
        except ClientDisconnected:
            return None
        finally:
            self._release(len(jobs))

    async def _stream(self, events, jobs: list[_Job]) -> Response:
        """``events(outputs)``'s stream; a constrained request's first output is awaited
        first, so that a grammar failure is a 400 (before any header)."""
        self._admit(len(jobs))
        try:
            outs = self._outputs(jobs, OutputKind.DELTA)
            if jobs[0].params.constraint is not None:
                outs = await self._started(outs, jobs[0].constraint_param)
        except BaseException:
            self._release(len(jobs))
            raise
        return EventStreamResponse(self._guarded(events(outs)), on_close=lambda: self._release(len(jobs)))

    @staticmethod
    async def _started(outs: AsyncIterator, param: str | None) -> AsyncIterator:
        """``outs`` with its first item already taken (raised as a 400 if its grammar failed)."""
        try:
            first = await anext(outs)
            error = failure(first[1], param)
            if error is not None:
                raise error
        except BaseException:
            await outs.aclose()
            raise

        async def chained():
            async with aclosing(outs):
                yield first
                async for item in outs:
                    yield item

        return chained()

    @staticmethod
    def _check_failures(outs: list[RequestOutput], jobs: list[_Job]) -> None:
        for out in outs:
            error = failure(out, jobs[0].constraint_param)
            if error is not None:
                raise error

    async def _guarded(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Once the stream began, a failure is an error event, then a clean end."""
        try:
            async with aclosing(events) as inner:
                async for event in inner:
                    yield event
        except APIError as exc:
            yield sse_error_event(exc, Flavor.OPENAI)
        except Exception as exc:
            yield sse_error_event(APIError(500, f"generation failed: {exc!r}", "generation"), Flavor.OPENAI)

    # -- /v1/completions ------------------------------------------------------------------
    @documented(summary="Completions (OpenAI)", tag="OpenAI", request=oa.CompletionRequest,
                response=oa.CompletionResponse, streams=True, error_model=oa.ErrorResponse)
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

    def _completion_jobs(self, body: oa.CompletionRequest) -> list[_Job]:
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
            jobs.append(_Job(index, text, ids, params, echo, body.priority, param))
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

    async def _completion_events(self, reply: _Reply, jobs: list[_Job], outputs: AsyncIterator) -> AsyncIterator[bytes]:
        choice_jobs = per_choice(jobs)  # streaming has no best_of > n: choices are samples
        for index, job in enumerate(choice_jobs):
            if job.echo:
                yield reply.chunk([{"index": index, "text": job.echo, "logprobs": None, "finish_reason": None}])
        num_tokens = 0  # every choice's generated tokens, for usage
        offsets = [len(job.echo) for job in choice_jobs]
        pending = [_Pending() for _ in choice_jobs]  # tokens whose logprobs are not sent yet
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
    @documented(summary="Chat completions (OpenAI)", tag="OpenAI", request=oa.ChatCompletionRequest,
                response=oa.ChatCompletionResponse, streams=True, error_model=oa.ErrorResponse)
    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await read_model(request, oa.ChatCompletionRequest)
            job, setup = await self.service.run_blocking(self._chat_job, body)
            reply = self._reply("chatcmpl", "chat.completion", body)
            if body.stream:
                chunk_reply = _Reply(reply.id, "chat.completion.chunk", reply.created, reply.model,
                                     reply.system_fingerprint, reply.include_usage)
                return await self._stream(lambda outs: self._chat_events(chunk_reply, job, setup, outs), [job])
            outs = await self._run(request, [job])
            if outs is not None and job.params.constraint is not None:
                self._check_failures(outs, [job])
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(outs):
            message, has_calls = assistant_message(out.outputs[0].text, setup)
            choices.append(oa.ChatChoice(index=i, message=message, finish_reason=finish_reason(out, has_calls),
                                         logprobs=self._chat_logprobs(body, out, 0)))
        response = oa.ChatCompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, system_fingerprint=reply.system_fingerprint,
            choices=choices, usage=usage([job], outs),
        )
        return JSONResponse(response.model_dump())

    def _tool_setup(self, body: oa.ChatCompletionRequest) -> ToolSetup:
        """400 for a tool choice naming no tool, or tools no parser of this model reads."""
        client = self.service.client
        try:
            return setup_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                               client.plugin_manager.registries.tool_parsers, client.chat_template)
        except ValueError as exc:
            param = "tools" if str(exc).startswith("tools") else "tool_choice"
            raise bad_request(str(exc), param) from None

    def _chat_job(self, body: oa.ChatCompletionRequest) -> tuple[_Job, ToolSetup]:
        check_not_yet(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise validation_error("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        setup = self._tool_setup(body) if body.tools or body.tool_choice is not None else NO_TOOLS
        constraint, param = openai_constraint(body) if body.has_structured_output else (None, None)
        if setup.forced is not None:
            if constraint is not None:
                raise bad_request(f"`{param}` cannot constrain an answer that tool_choice {setup.choice!r} forces "
                                  "to be a tool call", param)
            constraint, param = setup.forced, "tool_choice"
        if constraint is not None or body.guided_decoding_backend is not None:
            check_backend(self.service.client, constraint, body.guided_decoding_backend, "guided_decoding_backend")
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise validation_error(
                f"`max_tokens` ({body.max_tokens}) and `max_completion_tokens` ({body.max_completion_tokens}) "
                "disagree; send one of them", "max_completion_tokens",
            )
        self._check_stop(body)
        prompt = self._chat_prompt(body.messages, setup)
        ids = self.service.encode(prompt, add_special_tokens=False)
        length_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(body, self._max_tokens(len(ids), requested, "messages", length_param), constraint)
        self.service.validate(ids, params)
        return _Job(0, prompt, ids, params, priority=body.priority, constraint_param=param), setup

    def _chat_logprobs(self, body: oa.ChatCompletionRequest, out: RequestOutput, start: int) -> oa.ChatLogprobs | None:
        return chat_logprobs(self.service, out, start, body.top_logprobs or 0) if body.logprobs else None

    def _chat_prompt(self, messages: list[oa.ChatMessage], setup: ToolSetup) -> str:
        """The messages (tool calls and results among them) and the tools through the
        chat template (after a length check: the prompt holds every message's text)."""
        plain = []
        for i, message in enumerate(messages):
            content = message.content
            if content is None:
                if not (message.role == "assistant" and message.tool_calls):
                    raise validation_error(f"`messages[{i}].content` is missing", f"messages[{i}].content")
                content = ""
            elif not isinstance(content, str):
                for k, part in enumerate(content):
                    where = f"messages[{i}].content[{k}]"
                    if part.type != "text":
                        raise validation_error(
                            f"`{where}` has type {part.type!r}: only \"text\" parts are supported", f"{where}.type"
                        )
                    if part.text is None:
                        raise validation_error(f"`{where}` is a text part without `text`", f"{where}.text")
                content = "\n".join(part.text for part in content)  # type: ignore[misc]
            role = "system" if message.role == "developer" else message.role
            entry: dict = {"role": role, "content": content}
            if message.tool_calls:
                entry["tool_calls"] = message.tool_calls
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            plain.append(entry)
        self.service.check_chars("".join(m["content"] for m in plain), "messages")
        client = self.service.client
        try:
            tools = None
            if setup.tools or any("tool_calls" in m for m in plain):
                registry = client.plugin_manager.registries.tool_parsers
                plain, tools = chat_messages(plain, setup, registry, client.chat_template)
            return client.apply_chat_template(plain, tools)
        except (ValueError, TemplateError) as exc:
            raise validation_error(f"`messages` could not be formatted by the chat template: {exc}", "messages") from None

    async def _chat_events(
        self, reply: _Reply, job: _Job, setup: ToolSetup, outputs: AsyncIterator
    ) -> AsyncIterator[bytes]:
        num_choices = job.params.n
        for index in range(num_choices):
            yield reply.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        num_tokens = 0  # every choice's generated tokens, for usage
        num_top = job.params.logprobs
        pending = [_Pending() for _ in range(num_choices)]  # tokens whose logprobs are not sent yet

        def logprobs_of(index: int, out: RequestOutput) -> dict | None:
            view = pending[index].take(out)
            if num_top is None or not view.outputs[0].token_ids:
                return None
            return chat_logprobs(self.service, view, 0, num_top).model_dump()

        parsers = [setup.parser() if setup.parser else None for _ in range(num_choices)]
        has_calls = [False] * num_choices

        def delta_of(index: int, out: RequestOutput) -> dict:
            """The chunk's delta: the text, or what the choice's parser can report of it."""
            parser: BaseToolParser | None = parsers[index]
            if parser is None:
                return {"content": out.new_text} if out.new_text else {}
            parsed = parser.feed(out.new_text)
            if out.finished:
                end = parser.finish()
                parsed = ParserDelta(parsed.content + end.content, parsed.tool_calls + end.tool_calls)
            delta: dict = {"content": parsed.content} if parsed.content else {}
            pieces = tool_call_pieces(parsed, setup.max_calls)
            if pieces:
                delta["tool_calls"] = pieces
                has_calls[index] = True
            return delta

        async with aclosing(outputs) as outs:
            async for index, out in outs:
                error = failure(out, job.constraint_param) if out.outputs[0].finish_reason == "error" else None
                if error is not None:
                    raise error
                num_tokens += len(out.new_token_ids)
                pending[index].add(out)
                delta = delta_of(index, out)
                if delta:
                    yield reply.chunk([{"index": index, "delta": delta,
                                        "logprobs": logprobs_of(index, out), "finish_reason": None}])
                if out.finished:
                    yield reply.chunk([{"index": index, "delta": {}, "logprobs": logprobs_of(index, out),
                                        "finish_reason": finish_reason(out, has_calls[index])}])
        if reply.include_usage:
            yield reply.chunk([], usage([job], num_completion=num_tokens).model_dump())
        yield DONE_EVENT
