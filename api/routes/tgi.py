"""TGI routes: /generate, /generate_stream, / (compat), /tokenize.

`parameters.grammar` (``{"type": "json" | "regex", "value": ...}``) constrains the
output (`ember.api.structured_outputs`); as on the OpenAI routes, a constrained request
waits for its first engine output before answering, so a grammar that fails to compile
is a 400. TGI's chat route is the OpenAI one (/v1/chat/completions), tools included.
`parameters.adapter_id` selects a LoRA adapter by its name (null: the base model; a name
not loaded: 404, `GenerationService.adapter_for_id`). For a model that takes images,
markdown images in `inputs` (``![](url)``) are images, as TGI's vision models take them
(`ember.api.routes.media`).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, error_response, not_available, sse_error_event, validation_error
from ember.api.http import ClientDisconnected, EventStreamResponse, read_model, sse_event, unless_disconnected
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.routes.media import MARKDOWN_IMAGE, NeedsMedia, complete, markdown_images
from ember.api.schemas import tgi
from ember.api.service import GenerationService, with_watermark
from ember.api.structured_outputs import failure, tgi_constraint
from ember.logprobs import Logprob
from ember.multimodal.chat import ImageRef
from ember.outputs import OutputKind, RequestOutput
from ember.sampling_params import SamplingParams

Prepared = tuple[list[int], SamplingParams, tuple]  # a request's prompt ids, parameters and processed images

# parameter -> (neutral value that is accepted, where it will be implemented)
NOT_YET: dict = {}
NEUTRAL: dict = {}


def sampling_params(p: tgi.GenerateParameters, max_new_tokens: int) -> SamplingParams:
    for name, (default, issue) in NOT_YET.items():
        value = getattr(p, name)
        if value != default and value != NEUTRAL.get(name, default):
            raise not_available(f"parameters.{name}", issue)
    is_sampling = (
        p.do_sample or p.temperature is not None or p.top_k is not None or p.top_p is not None
        or p.typical_p is not None
    )
    best_of = p.best_of if p.best_of is not None and p.best_of > 1 else None
    if best_of is not None and not is_sampling:
        raise validation_error("`best_of` > 1 needs sampling: set `do_sample` (or temperature, top_k, top_p)", "best_of")
    seed = None
    if is_sampling:
        # TGI reports the seed it used, so that a sampled answer can be reproduced.
        seed = p.seed if p.seed is not None else random.getrandbits(63)
    try:
        return SamplingParams(
            temperature=(p.temperature if p.temperature is not None else 1.0) if is_sampling else 0.0,
            top_p=p.top_p if p.top_p is not None else 1.0,
            top_k=p.top_k if p.top_k is not None else -1,
            max_tokens=max_new_tokens,
            seed=seed,
            stop=tuple(p.stop),
            typical_p=p.typical_p if p.typical_p is not None else 1.0,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
            frequency_penalty=p.frequency_penalty if p.frequency_penalty is not None else 0.0,
            logprobs=p.top_n_tokens or None,
            prompt_logprobs=0 if p.decoder_input_details else None,
            extra=with_watermark(p.extra, p.watermark),
            best_of=best_of,
            best_of_ranking="mean",  # TGI's best_of: the highest mean logprob wins
            constraint=tgi_constraint(p.grammar),
        )
    except ValueError as exc:  # what only the core checks (an `extra` key naming a built-in...)
        raise validation_error(str(exc), "parameters") from None


def finish_reason(out: RequestOutput, eos_ids: tuple[int, ...]) -> str:
    completion = out.outputs[0]
    if completion.finish_reason == "length":
        return "length"
    if isinstance(completion.stop_reason, int) and completion.stop_reason in eos_ids:
        return "eos_token"
    return "stop_sequence"


def top_tokens(service: GenerationService, logprobs: dict[int, Logprob], num_top: int) -> list[tgi.Token]:
    """The `num_top` most likely tokens of one position, by rank (TGI's `top_tokens`)."""
    ranked = sorted((lp.rank, token_id) for token_id, lp in logprobs.items() if lp.rank <= num_top)
    return [
        tgi.Token(id=t, text=service.token_text(t), logprob=logprobs[t].logprob, special=service.is_special(t))
        for _, t in ranked
    ]


def prefill_tokens(service: GenerationService, ids: list[int], out: RequestOutput) -> list[tgi.Token]:
    """The prompt's tokens with their logprobs (`decoder_input_details`); the first has none."""
    lps = out.prompt_logprobs or [None] * len(ids)
    return [
        tgi.Token(id=t, text=service.token_text(t), logprob=None if lp is None else lp[t].logprob,
                  special=service.is_special(t))
        for t, lp in zip(ids, lps)
    ]


class TGIRoutes:
    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.generate, methods=["POST"]),
            Route("/generate_stream", self.generate_stream, methods=["POST"]),
            Route("/", self.compat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
        ]

    def _prepare(self, body: tgi.GenerateRequest, is_stream: bool = False) -> Prepared | NeedsMedia[Prepared]:
        """Tokenize and validate (on a preparation thread: `GenerationService.run_blocking`);
        with markdown images in `inputs`, up to them (`NeedsMedia`: `complete` finishes it)."""
        service = self.service
        if not body.inputs:
            raise APIError(422, "`inputs` is empty: give a non-empty prompt", "validation", "inputs")
        p = body.parameters
        if p.decoder_input_details and is_stream:
            raise APIError(
                422, "`decoder_input_details` == true is not supported when streaming tokens",
                "validation", "decoder_input_details",
            )
        if is_stream and p.best_of is not None and p.best_of > 1:
            raise APIError(422, "`best_of` > 1 is not supported when streaming tokens", "validation", "best_of")
        if p.truncate is not None and p.truncate > service.limits.max_input_tokens:
            raise APIError(
                422, f"`truncate` must be <= {service.limits.max_input_tokens}. Given: {p.truncate}",
                "validation", "truncate",
            )
        service.check_stop(p.stop, "stop")
        text, images = self._inputs(body.inputs)
        if images and p.truncate is not None:
            raise validation_error("`truncate` cannot cut a prompt that holds images: remove it, or the images",
                                   "truncate")
        if p.truncate is None:
            service.check_chars(text, "inputs")

        def finish(ids: list[int], mm_items: tuple = ()) -> Prepared:
            max_new = service.check_lengths(len(ids), p.max_new_tokens)
            params = sampling_params(p, max_new)
            service.validate(ids, params)
            return ids, params, mm_items

        ids = service.encode(text)
        if p.truncate is not None:
            ids = ids[-p.truncate :]
        return NeedsMedia(ids, images, "inputs", finish, text, True) if images else finish(ids)

    def _inputs(self, inputs: str) -> tuple[str, list[ImageRef]]:
        """`inputs` as the model reads it: for a model that takes images, each markdown image
        (``![](url)``, TGI's way) becomes the model's placeholder text there; for one that
        takes none, the text as it is (as TGI)."""
        if "](" not in inputs or MARKDOWN_IMAGE.search(inputs) is None:
            return inputs, []
        image_text = self.service.media.image_text
        if image_text is None:
            return inputs, []
        return markdown_images(inputs, image_text, "inputs")

    # -- /generate --------------------------------------------------------------
    @documented(summary="Generate text (TGI)", tag="TGI", request=tgi.GenerateRequest,
                response=tgi.GenerateResponse, error_model=tgi.ErrorResponse, errors=GENERATION_ERRORS)
    async def generate(self, request: Request) -> Response:
        try:
            body = await read_model(request, tgi.GenerateRequest)
            return await self._generate(request, body)
        except APIError as exc:
            return error_response(exc, Flavor.TGI)

    async def _generate(self, request: Request, body: tgi.GenerateRequest) -> Response:
        service = self.service
        adapter = service.adapter_for_id(body.parameters.adapter_id)
        ids, params, mm_items = await complete(service, await service.run_blocking(self._prepare, body))
        media = {"mm_items": mm_items} if mm_items else {}  # a text request calls the service as before
        with service.admit():
            try:
                final = service.generate_final(body.inputs, ids, params, body.parameters.priority, adapter, **media)
                out = await unless_disconnected(request, final)
            except ClientDisconnected:
                return Response(status_code=499)
        error = failure(out, "grammar") if params.constraint is not None else None
        if error is not None:
            raise error
        # best_of: the engine ranked the candidates by mean logprob (as TGI); the best
        # answers, the others are reported in details.best_of_sequences
        views = [replace(out, outputs=[c]) for c in out.outputs + (out.candidates or [])]
        response: dict = {"generated_text": self._text(body, views[0])}
        if body.parameters.details:
            details = self._details(body, ids, params, views[0])
            if len(views) > 1:
                details.best_of_sequences = [
                    tgi.BestOfSequence(generated_text=self._text(body, v), **self._details(body, ids, params, v).model_dump(
                        include={"finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens"}))
                    for v in views[1:]
                ]
            response["details"] = details.model_dump()
        return JSONResponse(response)

    @staticmethod
    def _text(body: tgi.GenerateRequest, out: RequestOutput) -> str:
        text = out.outputs[0].text
        return (body.inputs + text) if body.parameters.return_full_text else text

    def _details(self, body: tgi.GenerateRequest, ids: list[int], params: SamplingParams, out: RequestOutput) -> tgi.Details:
        """Details of one sequence (``out`` holds exactly one completion)."""
        service = self.service
        completion = out.outputs[0]
        tokens = [
            tgi.Token(id=t, text=service.token_text(t), logprob=lp, special=service.is_special(t))
            for t, lp in zip(completion.token_ids, completion.token_logprobs)
        ]
        num_top = body.parameters.top_n_tokens or 0
        return tgi.Details(
            finish_reason=finish_reason(out, service.model_info.eos_token_ids),
            generated_tokens=len(completion.token_ids),
            seed=completion.seed,  # a best_of candidate's own (child i: seed + i)
            prefill=prefill_tokens(service, ids, out) if body.parameters.decoder_input_details else [],
            tokens=tokens,
            top_tokens=[top_tokens(service, lp, num_top) for lp in completion.logprobs] if num_top else [],
        )

    # -- /generate_stream ----------------------------------------------------------
    @documented(summary="Generate text as server-sent events (TGI)", tag="TGI", request=tgi.GenerateRequest,
                response=tgi.StreamResponse, streams=True, error_model=tgi.ErrorResponse, errors=GENERATION_ERRORS)
    async def generate_stream(self, request: Request) -> Response:
        try:
            body = await read_model(request, tgi.GenerateRequest)
            return await self._stream(body)
        except APIError as exc:
            return error_response(exc, Flavor.TGI)

    async def _stream(self, body: tgi.GenerateRequest) -> Response:
        service = self.service
        adapter = service.adapter_for_id(body.parameters.adapter_id)
        ids, params, mm_items = await complete(service, await service.run_blocking(self._prepare, body, True))
        service.acquire()
        try:
            media = {"mm_items": mm_items} if mm_items else {}
            outs = service.generate(body.inputs, ids, params, body.parameters.priority, OutputKind.DELTA, adapter,
                                    **media)
            first = None
            if params.constraint is not None:  # a grammar that fails is a 400, before any header
                try:
                    first = await anext(outs)
                except BaseException:
                    await outs.aclose()
                    raise
                error = failure(first, "grammar")
                if error is not None:
                    await outs.aclose()
                    raise error
        except BaseException:
            service.release()
            raise
        return EventStreamResponse(self._events(body, ids, params, outs, first), on_close=service.release)

    async def _events(
        self, body: tgi.GenerateRequest, ids: list[int], params: SamplingParams, outs: AsyncIterator[RequestOutput],
        first: RequestOutput | None,
    ) -> AsyncIterator[bytes]:
        """``first`` (already taken from ``outs``, or None), then the rest of ``outs``."""
        service = self.service
        index = 0
        text = ""  # the generated text so far: each output carries only what is new

        async def outputs():
            async with aclosing(outs):
                if first is not None:
                    yield first
                async for out in outs:
                    yield out

        try:
            async for out in outputs():
                error = failure(out, "grammar") if params.constraint is not None else None
                if error is not None:
                    raise error
                completion = out.outputs[0]
                new_ids = out.new_token_ids
                text += completion.text
                for k, token_id in enumerate(new_ids):
                    index += 1
                    is_last = out.finished and k == len(new_ids) - 1
                    num_top = body.parameters.top_n_tokens or 0
                    event: dict = {
                        "index": index,
                        "token": {
                            "id": token_id,
                            "text": out.new_text if k == len(new_ids) - 1 else "",
                            "logprob": completion.token_logprobs[k],
                            "special": service.is_special(token_id),
                        },
                        "top_tokens": [
                            t.model_dump() for t in top_tokens(service, completion.logprobs[k], num_top)
                        ] if num_top else None,
                        "generated_text": None,
                        "details": None,
                    }
                    if is_last:
                        event["generated_text"] = (body.inputs + text) if body.parameters.return_full_text else text
                        event["details"] = {
                            "finish_reason": finish_reason(out, service.model_info.eos_token_ids),
                            "generated_tokens": index,
                            "seed": params.seed,
                            "input_length": len(ids),
                        }
                    yield sse_event(event)
        except APIError as exc:
            yield sse_error_event(exc, Flavor.TGI)
        except Exception as exc:  # never a broken stream: an error event, then a clean end
            yield sse_error_event(APIError(500, f"generation failed: {exc!r}", "generation"), Flavor.TGI)

    # -- / (compat) -----------------------------------------------------------------
    @documented(summary="TGI compat route: /generate or /generate_stream by `stream`", tag="TGI",
                request=tgi.CompatGenerateRequest, response=tgi.GenerateResponse, streams=True,
                error_model=tgi.ErrorResponse, errors=GENERATION_ERRORS)
    async def compat(self, request: Request) -> Response:
        try:
            body = await read_model(request, tgi.CompatGenerateRequest)
            if body.stream:
                return await self._stream(body)
            return await self._generate(request, body)
        except APIError as exc:
            return error_response(exc, Flavor.TGI)

    # -- /tokenize --------------------------------------------------------------------
    @documented(summary="Tokenize a prompt", tag="TGI", request=tgi.TokenizeRequest,
                response=tgi.SimpleToken, response_is_list=True, error_model=tgi.ErrorResponse)
    async def tokenize(self, request: Request) -> Response:
        try:
            body = await read_model(request, tgi.TokenizeRequest)
            return JSONResponse(await self.service.run_blocking(self._tokens, body))
        except APIError as exc:
            return error_response(exc, Flavor.TGI)

    def _tokens(self, body: tgi.TokenizeRequest) -> list[dict]:
        """The prompt's tokens as /generate would see them: at most --max-input-tokens
        (422 past it), or the last `parameters.truncate`."""
        service = self.service
        truncate = body.parameters.truncate if body.parameters is not None else None
        if truncate is not None and truncate > service.limits.max_input_tokens:
            raise validation_error(
                f"`truncate` must be <= {service.limits.max_input_tokens}. Given: {truncate}", "truncate"
            )
        if truncate is None:
            service.check_chars(body.inputs, "inputs")
        max_input = service.limits.max_input_tokens
        num_tokens, ids, offsets = service.encode_with_offsets(body.inputs, truncate or max_input)
        if truncate is None and num_tokens > max_input:
            raise validation_error(f"`inputs` must have at most {max_input} tokens. Given: {num_tokens}", "inputs")
        return [
            {"id": token_id, "text": body.inputs[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(ids, offsets)
        ]
