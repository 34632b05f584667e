"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, and
POST /v1/responses/{id}/cancel.

A request is mapped onto the chat path (`ChatRoutes`): its input items become chat
messages (`responses_items`; `input_image` parts the chat's image parts), its tools,
tool choice and `text.format` the chat's tools, forced calls and structured outputs, so
the chat template, the images, the tool-call and reasoning parsers and the grammar
backends are the chat route's. The answer comes back as output items (`reasoning`,
`message`, `function_call`), streamed with OpenAI's events (`responses_events`). `store` (default true) keeps the response and its
conversation in the bounded `ResponsesStore`, which `previous_response_id` continues
and GET reads. Errors have OpenAI's shape; a field Ember cannot honour is a 400 naming
it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, bad_request, error_response, from_validation_error, note_error
from ember.api.http import parse_model, read_json
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.responses_store import ResponsesStore
from ember.api.routes import responses_items as items
from ember.api.routes.media import NeedsMedia, complete, then
from ember.api.routes.openai import AnswerReader, Job
from ember.api.routes.openai_chat import ChatRoutes
from ember.api.routes.responses_events import EventWriter
from ember.api.schemas import openai as oa
from ember.api.schemas import responses as rs
from ember.api.service import GenerationService
from ember.api.structured_outputs import failure
from ember.engine.tool_calls import ToolSetup
from ember.outputs import RequestOutput

# request fields passed to the chat request under the same name
SAME_FIELDS = ("model", "parallel_tool_calls", "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "stop", "priority", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "guided_decoding_backend", "structured_outputs", "user")


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked request: its engine job, tools, and what the response echoes."""

    body: rs.ResponsesRequest
    job: Job
    setup: ToolSetup
    conversation: list[dict[str, Any]]  # every input item (earlier turns' too)
    id: str
    created_at: int


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"response {response_id!r} not found: unknown, expired, evicted from the store, or created "
                    "with `store: false`", "not_found", param)


class ResponsesRoutes(ChatRoutes):
    def __init__(self, service: GenerationService, store: ResponsesStore) -> None:
        super().__init__(service)
        self.store = store

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
                Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"])]

    @documented(summary="Responses (OpenAI)", tag="OpenAI", request=rs.ResponsesRequest, response=rs.ResponseObject,
                streams=True, error_model=oa.ErrorResponse, errors=GENERATION_ERRORS)
    async def create(self, request: Request) -> Response:
        try:
            data = await read_json(request)
            if isinstance(data, dict):
                items.check_refused(data)
            try:
                body = parse_model(rs.ResponsesRequest, data)
            except APIError as exc:  # OpenAI answers 400 for a malformed field
                raise bad_request(exc.message, exc.param) from None
            plan = await self._planned(body)
            if body.stream:
                return await self._stream(lambda outs: self._events(plan, outs), [plan.job])
            outs = await self._run(request, [plan.job])
            if outs is not None and plan.job.params.constraint is not None:
                self._check_failures(outs, [plan.job])
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        response = self._response(plan, self._output(out, plan.setup), out, len(out.outputs[0].token_ids))
        self._keep(plan, response)
        return JSONResponse(response)

    @documented(summary="A stored response (OpenAI Responses)", tag="OpenAI", response=rs.ResponseObject)
    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        refused = next((name for name in ("stream", "starting_after", "include") if name in request.query_params), None)
        if refused is not None:  # a background response's stream, or optional output Ember does not fill
            return error_response(bad_request(f"query parameter `{refused}` is not supported by Ember (it has no "
                                              "background responses and fills no `include` values)", refused),
                                  Flavor.OPENAI)
        entry = self.store.get(response_id)
        if entry is None:
            return error_response(not_found(response_id), Flavor.OPENAI)
        return JSONResponse(entry.response)

    @documented(summary="Delete a stored response (OpenAI Responses)", tag="OpenAI", response=rs.DeletedResponse)
    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            return error_response(not_found(response_id), Flavor.OPENAI)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @documented(summary="A stored response's input items (OpenAI Responses)", tag="OpenAI")
    async def input_items(self, request: Request) -> Response:
        """Every item the response read (earlier turns' too), newest first unless `order=asc`,
        `limit` (1-100, default 20) a page, `after` an item id to page on from."""
        try:
            entry = self.store.get(request.path_params["response_id"])
            if entry is None:
                raise not_found(request.path_params["response_id"])
            listed = [items.listed_item(item) for item in entry.conversation[: entry.num_input]]
            page, has_more = items.page(listed, dict(request.query_params))
        except APIError as exc:
            return error_response(exc, Flavor.OPENAI)
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": has_more})

    @documented(summary="Cancel a background response (OpenAI Responses): Ember has none", tag="OpenAI")
    async def cancel(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if self.store.get(response_id) is None:
            return error_response(not_found(response_id), Flavor.OPENAI)
        return error_response(bad_request(f"response {response_id!r} cannot be cancelled: only background responses "
                                          "can, and Ember has no background mode (it has already finished)",
                                          "response_id"), Flavor.OPENAI)

    # -- the request ------------------------------------------------------------------------
    async def _planned(self, body: rs.ResponsesRequest) -> Plan:
        """`_plan` on a preparation thread, and its images loaded and processed (`complete`);
        an error about a chat field names the Responses field."""
        try:
            return await complete(self.service, await self.service.run_blocking(self._plan, body))
        except APIError as exc:
            raise items.renamed(exc) from None

    def _plan(self, body: rs.ResponsesRequest) -> Plan | NeedsMedia[Plan]:
        """The chat request this one means, checked and tokenized (on a preparation thread)."""
        self.service.adapter_for_model(body.model)  # a 404 before the items are read
        if body.stream_options is not None and not body.stream:
            raise bad_request("`stream_options` is only allowed with `stream: true`", "stream_options")
        conversation: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            entry = self.store.get(body.previous_response_id)
            if entry is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            conversation = list(entry.conversation)
        conversation += items.check_items(body.input)
        fields: dict[str, Any] = {name: getattr(body, name) for name in SAME_FIELDS}
        places: dict[str, str] = {}  # each image part of the chat request -> its input part
        fields.update(messages=items.chat_messages(conversation, body.instructions, places),
                      tools=items.chat_tools(body.tools), tool_choice=items.chat_tool_choice(body.tool_choice),
                      response_format=items.response_format(body.text), max_completion_tokens=body.max_output_tokens,
                      stream=body.stream)
        try:
            chat = oa.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            err = items.renamed(from_validation_error(exc))
            raise bad_request(err.message, err.param) from None
        try:
            prepared = self._chat_job(chat, places)
        except APIError as exc:
            raise items.renamed(exc) from None

        def plan(prepared: tuple[Job, ToolSetup]) -> Plan:
            job, setup = prepared
            if job.constraint_param in items.CHAT_NAMES:  # a grammar that fails names the Responses field
                job = replace(job, constraint_param=items.CHAT_NAMES[job.constraint_param])
            return Plan(body, job, setup, conversation, items.new_id("resp"), int(time.time()))

        return then(prepared, plan)

    # -- the answer ---------------------------------------------------------------------------
    def _output(self, out: RequestOutput, setup: ToolSetup) -> list[dict[str, Any]]:
        """A finished answer as output items: its reasoning, its text, its calls."""
        text, reasoning = out.outputs[0].text, None
        parser = self._reasoning_parser()
        if parser is not None:
            reasoning, text = parser().extract(text)
        status = "incomplete" if out.outputs[0].finish_reason == "length" else "completed"
        output = [items.reasoning_item(reasoning)] if reasoning else []
        calls = ()
        if setup.parser is not None:
            parsed = setup.parser().parse(text)
            calls = parsed.tool_calls[: setup.max_calls]
            if calls:
                text = parsed.content or ""
        if text or not calls:
            output.append(items.message_item(text, status))
        output += [items.function_call_item(call.id, call.name, call.arguments) for call in calls]
        return output

    def _response(self, plan: Plan, output: list[dict[str, Any]], last: RequestOutput | None, num_output: int = 0,
                  error: APIError | None = None) -> dict[str, Any]:
        """The response object (``last``: the final engine output, ``num_output`` its generated
        tokens; None while in progress)."""
        body = plan.body
        if error is not None:
            status = "failed"
        elif last is None:
            status = "in_progress"
        else:
            status = "incomplete" if last.outputs[0].finish_reason == "length" else "completed"
        tools = [{"description": None, "parameters": None, "strict": None, **tool} for tool in body.tools or []]
        return {
            "id": plan.id, "object": "response", "created_at": plan.created_at, "status": status,
            "background": False,
            "error": None if error is None else {"code": error.error_type, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": body.store,
            "temperature": plan.job.params.temperature, "top_p": plan.job.params.top_p,
            "text": {"format": body.text.format.model_dump(exclude_none=True, by_alias=True)}
            if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            "tools": tools, "truncation": "disabled",
            "usage": None if last is None else self._usage(plan, output, last, num_output),
            "user": body.user, "metadata": body.metadata or {},
        }

    def _usage(self, plan: Plan, output: list[dict[str, Any]], last: RequestOutput, num_output: int) -> dict[str, Any]:
        num_input = len(plan.job.prompt_ids)
        reasoning = "".join(item["content"][0]["text"] for item in output if item["type"] == "reasoning")
        num_reasoning = len(self.service.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        num_reasoning = min(num_output, num_reasoning)
        num_cached = last.metrics.num_cached_tokens if last.metrics is not None else 0
        return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
                "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
                "total_tokens": num_input + num_output}

    def _keep(self, plan: Plan, response: dict[str, Any]) -> None:
        """Store a finished response (with `store`), and the conversation it ends."""
        if plan.body.store and response["status"] != "failed":
            conversation = plan.conversation + [items.as_input_item(item) for item in response["output"]]
            self.store.put(response, conversation, plan.body.model, len(plan.conversation))

    async def _events(self, plan: Plan, outputs: AsyncIterator) -> AsyncIterator[bytes]:
        writer = EventWriter()
        for event in writer.start(self._response(plan, [], None)):
            yield event
        setup = plan.setup
        reader = AnswerReader(self._reasoning_parser(), setup.parser)
        last: RequestOutput | None = None
        num_tokens = 0
        try:
            async with aclosing(outputs) as outs:
                async for _, out in outs:
                    error = failure(out, plan.job.constraint_param) if out.outputs[0].finish_reason == "error" else None
                    if error is not None:
                        raise error
                    num_tokens += len(out.new_token_ids)
                    last = out
                    for event in self._pieces(writer, reader, setup.max_calls, out):
                        yield event
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {exc!r}", "generation")
            note_error(error)
            yield writer.error(error.message, error.error_type, error.param)
            yield writer.end(self._response(plan, writer.output, None, error=error))
            return
        status = "incomplete" if last is not None and last.outputs[0].finish_reason == "length" else "completed"
        if not writer.output or writer.output[-1]["type"] == "reasoning":
            for event in writer.text(""):  # no answer text: an empty message, as the unstreamed answer has
                yield event
        for event in writer.close(status):
            yield event
        response = self._response(plan, writer.output, last, num_tokens)
        self._keep(plan, response)
        yield writer.end(response)

    @staticmethod
    def _pieces(writer: EventWriter, reader: AnswerReader, max_calls: int | None, out: RequestOutput) -> list[bytes]:
        """One engine output's events: its reasoning, then its text and call pieces."""
        events: list[bytes] = []
        reasoning, content, calls = reader.feed(out.new_text, out.finished)
        if reasoning:
            events += writer.reasoning(reasoning)
        if content:
            events += writer.text(content)
        for piece in calls:
            if max_calls is not None and piece.index >= max_calls:
                continue
            if piece.id is not None:
                events += writer.call(piece.id, piece.name)
            if piece.arguments:
                events += writer.arguments(piece.arguments)
        return events
