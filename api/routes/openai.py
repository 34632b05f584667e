"""What the OpenAI routes share (each route is its own module: `openai_chat` for
/v1/chat/completions, `openai_completions` for /v1/completions): `OpenAIRoutes`, their
base (sampling fields to `SamplingParams`, admission, streaming, failures), and the
response pieces (choices, usage, logprobs).

`model` selects a LoRA adapter by its name (`GenerationService.adapter_for_model`);
the served model's name is the base model, another name a 404. With adapters off any
name is the base model (as TGI does); it is echoed back either way.
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

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.api.errors import (
    APIError,
    Flavor,
    sse_error_event,
    validation_error,
)
from ember.api.http import ClientDisconnected, EventStreamResponse, sse_event, unless_disconnected
from ember.api.schemas import openai as oa
from ember.api.service import GenerationService, with_watermark
from ember.api.structured_outputs import failure
from ember.constraint import Constraint
from ember.outputs import OutputKind, RequestOutput
from ember.plugin.reasoning_parser import BaseReasoningParser
from ember.plugin.tool_parser import BaseToolParser, ToolCallDelta
from ember.sampling_params import SamplingParams

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Job:
    """One engine request behind one choice of the answer."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # text put before the generated text (`echo`)
    priority: int = 0
    constraint_param: str | None = None  # the field its constraint came from (named by a 400)
    adapter: str | None = None  # the LoRA adapter it runs under; None: the base model
    mm_items: tuple = ()  # its processed images (`ember.api.routes.media`); prompt_ids expanded


@dataclass(frozen=True, slots=True)
class Reply:
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


class Pending:
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


def per_choice(jobs: list[Job]) -> list[Job]:
    """The job behind each returned choice, in choice order."""
    return [job for job in jobs for _ in range(job.params.n)]


def finish_reason(out: RequestOutput, has_tool_calls: bool = False) -> str:
    if out.outputs[0].finish_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def usage(jobs: list[Job], outs: list[RequestOutput] | None = None, num_completion: int = 0) -> oa.Usage:
    """Prompts count once each (whatever n is); every returned choice's tokens count
    (those of ``outs``' cumulative outputs, else ``num_completion``)."""
    num_prompt = sum(len(job.prompt_ids) for job in jobs)
    if outs is not None:
        num_completion = sum(len(out.outputs[0].token_ids) for out in outs)
    return oa.Usage(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion)


def top_logprob(service: GenerationService, token_id: int, logprob: float) -> oa.TopLogprob:
    text = service.token_text(token_id)
    return oa.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


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
        raise NotImplementedError

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

    def _reply(self, prefix: str, object_name: str, body: oa.SamplingFields) -> Reply:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return Reply(f"{prefix}-{uuid.uuid4().hex}", object_name, int(time.time()), body.model,
                      self.system_fingerprint, include_usage)

    def _generate(self, job: Job, kind: OutputKind = OutputKind.CUMULATIVE) -> AsyncIterator[RequestOutput]:
        """The service's outputs for one job (its adapter and images named only when it has them)."""
        adapter = {"adapter": job.adapter} if job.adapter is not None else {}
        if job.mm_items:
            adapter["mm_items"] = job.mm_items
        return self.service.generate(job.prompt, job.prompt_ids, job.params, job.priority, kind, **adapter)

    async def _outputs(
        self, jobs: list[Job], kind: OutputKind = OutputKind.CUMULATIVE
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
            async with aclosing(self._generate(job, kind)) as outs:
                async for out in outs:
                    yield job.index, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

        async def pump(job: Job) -> None:
            k = job.params.num_samples
            try:
                async with aclosing(self._generate(job, kind)) as outs:
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

    async def _final_outputs(self, jobs: list[Job]) -> list[RequestOutput]:
        """One finished view per returned choice, in choice order: each job's final
        output holds its n completions (the n best of best_of, chosen by the engine)."""

        async def final(job: Job) -> RequestOutput:
            last = None
            async with aclosing(self._generate(job)) as outs:
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

    async def _run(self, request: Request, jobs: list[Job]) -> list[RequestOutput] | None:
        """Run to the end; None if the client left (its requests are then aborted)."""
        self._admit(len(jobs))
        try:
            return await unless_disconnected(request, self._final_outputs(jobs))
        except ClientDisconnected:
            return None
        finally:
            self._release(len(jobs))

    async def _stream(self, events, jobs: list[Job]) -> Response:
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
    def _check_failures(outs: list[RequestOutput], jobs: list[Job]) -> None:
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


class AnswerReader:
    """One generated answer read as it streams, for the chat, Messages and Responses
    streams alike: the reasoning parser (--reasoning-parser) first, then the tool-call
    parser on what follows the reasoning; the last piece (``finished``) flushes both.
    Without either parser the text passes through untouched (a plain request calls
    nothing of the parser contracts)."""

    def __init__(self, reasoning_cls: type[BaseReasoningParser] | None, parser_cls: type[BaseToolParser] | None) -> None:
        self.thinker = reasoning_cls() if reasoning_cls is not None else None
        self.parser = parser_cls() if parser_cls is not None else None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool-call pieces) of the next piece of generated text."""
        reasoning = ""
        if self.thinker is not None:
            piece, end = self.thinker.feed(text), (self.thinker.finish() if finished else None)
            reasoning, text = piece.reasoning, piece.content
            if end is not None:
                reasoning, text = reasoning + end.reasoning, text + end.content
        if self.parser is None:
            return reasoning, text, []
        parsed = self.parser.feed(text)
        if not finished:
            return reasoning, parsed.content, list(parsed.tool_calls)
        end = self.parser.finish()
        return reasoning, parsed.content + end.content, [*parsed.tool_calls, *end.tool_calls]
