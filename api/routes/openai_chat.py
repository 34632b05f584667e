"""POST /v1/chat/completions (OpenAI): messages through the chat template, tools and
tool_choice (a tool-call parser, `ember.engine.tool_calls`, reads the answer into
`tool_calls`, streamed as OpenAI does), logprobs, structured outputs; `image_url` parts
for a model that takes images (each becomes the model's placeholder in the text, the
image is loaded and processed by `ember.api.routes.media`). The plumbing it shares with
/v1/completions is `ember.api.routes.openai`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import (
    APIError,
    Flavor,
    bad_request,
    error_response,
    validation_error,
)
from ember.api.http import read_model
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.routes.media import NeedsMedia, complete, relocated
from ember.api.routes.openai import (
    DONE_EVENT,
    AnswerReader,
    Job,
    OpenAIRoutes,
    Pending,
    Reply,
    check_not_yet,
    finish_reason,
    top_logprob,
    usage,
)
from ember.api.schemas import openai as oa
from ember.api.service import GenerationService
from ember.api.structured_outputs import after_reasoning, check_backend, failure, openai_constraint
from ember.engine.tool_calls import NO_TOOLS, ToolSetup, chat_messages, setup_tools
from ember.multimodal.chat import ImageRef, join_openai_parts
from ember.multimodal.limits import MediaError
from ember.outputs import RequestOutput
from ember.plugin.reasoning_parser import BaseReasoningParser
from ember.plugin.tool_parser import ToolCallDelta


def tool_call_pieces(calls: list[ToolCallDelta], max_calls: int | None) -> list[dict]:
    """A parser's call pieces as OpenAI's `delta.tool_calls` entries."""
    pieces = []
    for piece in calls:
        if max_calls is not None and piece.index >= max_calls:
            continue
        function = {"arguments": piece.arguments}
        entry: dict = {"index": piece.index, "function": function}
        if piece.id is not None:
            entry.update(id=piece.id, type="function")
            function["name"] = piece.name
        pieces.append(entry)
    return pieces


def check_message_tool_calls(calls: list[dict], where: str) -> None:
    """400 naming the field for a malformed `tool_calls` entry of a request message (the
    chat template and the tool parsers read `function.name` and `function.arguments`)."""
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if call.get("type", "function") != "function":
            raise bad_request(f'`{at}.type` must be "function", got {call["type"]!r}'[:300], f"{at}.type")
        if "id" in call and not isinstance(call["id"], str):
            raise bad_request(f"`{at}.id` must be a string", f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise bad_request(f'`{at}.function` must be an object {{"name": ..., "arguments": ...}}', f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"`{at}.function.name` must be a non-empty string", f"{at}.function.name")
        arguments = function.get("arguments", "")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise bad_request(f"`{at}.function.arguments` is not JSON: {arguments[:200]!r}",
                                  f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise bad_request(f"`{at}.function.arguments` must be a JSON object (or a string holding one)",
                              f"{at}.function.arguments")


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


def chat_logprobs(service: GenerationService, out: RequestOutput, start: int, num_top: int) -> oa.ChatLogprobs:
    """`choices[].logprobs` of the chat API for generated tokens ``start ...``."""
    content = []
    for logprobs, token_id in zip(out.outputs[0].logprobs[start:], out.outputs[0].token_ids[start:]):
        ranked = sorted((lp.rank, t) for t, lp in logprobs.items() if lp.rank <= num_top)
        top = [top_logprob(service, t, logprobs[t].logprob) for _, t in ranked]
        chosen = top_logprob(service, token_id, logprobs[token_id].logprob)
        content.append(oa.TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return oa.ChatLogprobs(content=content)




class ChatRoutes(OpenAIRoutes):
    @documented(summary="Chat completions (OpenAI)", tag="OpenAI", request=oa.ChatCompletionRequest,
                response=oa.ChatCompletionResponse, streams=True, error_model=oa.ErrorResponse,
                errors=GENERATION_ERRORS)
    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await read_model(request, oa.ChatCompletionRequest)
            prepared = await self.service.run_blocking(self._chat_job, body)
            # (a text-only chat never enters the images' module: the request path stays short)
            job, setup = await complete(self.service, prepared) if isinstance(prepared, NeedsMedia) else prepared
            reply = self._reply("chatcmpl", "chat.completion", body)
            if body.stream:
                chunk_reply = Reply(reply.id, "chat.completion.chunk", reply.created, reply.model,
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
        reasoning_parser = self._reasoning_parser()
        for i, out in enumerate(outs):
            text, reasoning = out.outputs[0].text, None
            if reasoning_parser is not None:
                reasoning, text = reasoning_parser().extract(text)
            message, has_calls = assistant_message(text, setup)
            message.reasoning_content = reasoning
            choices.append(oa.ChatChoice(index=i, message=message, finish_reason=finish_reason(out, has_calls),
                                         logprobs=self._chat_logprobs(body, out, 0)))
        response = oa.ChatCompletionResponse(
            id=reply.id, created=reply.created, model=reply.model, system_fingerprint=reply.system_fingerprint,
            choices=choices, usage=usage([job], outs),
        )
        data = response.model_dump()
        if reasoning_parser is None:  # the field only with --reasoning-parser, as vLLM
            for choice in data["choices"]:
                del choice["message"]["reasoning_content"]
        return JSONResponse(data)

    def _reasoning_parser(self) -> type[BaseReasoningParser] | None:
        """The class of --reasoning-parser, None when off (`ember serve` checked the name)."""
        name = self.service.info.reasoning_parser
        return None if name is None else self.service.client.plugin_manager.registries.reasoning_parsers.get(name)

    def _tool_setup(self, body: oa.ChatCompletionRequest) -> ToolSetup:
        """400 for a tool choice naming no tool, or tools no parser of this model reads."""
        client = self.service.client
        try:
            return setup_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                               client.plugin_manager.registries.tool_parsers, client.chat_template,
                               self.service.info.tool_call_parser)
        except ValueError as exc:
            param = "tools" if str(exc).startswith("tools") else "tool_choice"
            raise bad_request(str(exc), param) from None

    def _chat_job(self, body: oa.ChatCompletionRequest, places: dict[str, str] | None = None
                  ) -> tuple[Job, ToolSetup] | NeedsMedia[tuple[Job, ToolSetup]]:
        """The request checked, templated and tokenized; with images, `NeedsMedia` (which
        `complete` finishes once they are processed). ``places``: see `_chat_prompt`."""
        adapter = self.service.adapter_for_model(body.model)
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
        prompt, images = self._chat_prompt(body.messages, setup, places)

        def finish(ids: list[int], mm_items: tuple = ()) -> tuple[Job, ToolSetup]:
            length_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
            requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            params = self._params(body, self._max_tokens(len(ids), requested, "messages", length_param), constraint)
            if params.constraint is not None:  # a plain request calls nothing of the grammar plumbing
                params = after_reasoning(params, self._reasoning_parser())
            self.service.validate(ids, params)
            return Job(0, prompt, ids, params, priority=body.priority, constraint_param=param, adapter=adapter,
                       mm_items=mm_items), setup

        ids = self.service.encode(prompt, add_special_tokens=False)
        return NeedsMedia(ids, images, "messages", finish, prompt) if images else finish(ids)

    def _chat_logprobs(self, body: oa.ChatCompletionRequest, out: RequestOutput, start: int) -> oa.ChatLogprobs | None:
        return chat_logprobs(self.service, out, start, body.top_logprobs or 0) if body.logprobs else None

    def _chat_prompt(self, messages: list[oa.ChatMessage], setup: ToolSetup, places: dict[str, str] | None = None
                     ) -> tuple[str, list[ImageRef]]:
        """The messages (tool calls and results among them) and the tools through the
        chat template (after a length check: the prompt holds every message's text), and
        the images its image parts name, in order (each part is the model's placeholder
        text in its message). ``places``: this request's part -> the part of the client's
        request it was made from (the Messages and Responses APIs), named by errors."""
        plain = []
        images: list[ImageRef] = []
        for i, message in enumerate(messages):
            content = message.content
            if content is None:
                if not (message.role == "assistant" and message.tool_calls):
                    raise validation_error(f"`messages[{i}].content` is missing", f"messages[{i}].content")
                content = ""
            elif not isinstance(content, str):
                content = self._parts_text(content, f"messages[{i}].content", images, places)
            role = "system" if message.role == "developer" else message.role
            entry: dict = {"role": role, "content": content}
            if message.tool_calls:
                if message.role != "assistant":
                    raise bad_request(f"`messages[{i}].tool_calls` is only for assistant messages",
                                      f"messages[{i}].tool_calls")
                check_message_tool_calls(message.tool_calls, f"messages[{i}].tool_calls")
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
                plain, tools = chat_messages(plain, setup, registry, client.chat_template, self.service.info.tool_call_parser)
            return client.apply_chat_template(plain, tools), images
        except (ValueError, TemplateError) as exc:
            raise validation_error(f"`messages` could not be formatted by the chat template: {exc}", "messages") from None

    def _parts_text(self, parts: list[oa.TextContentPart], where: str, images: list[ImageRef],
                    places: dict[str, str] | None) -> str:
        """A message's parts as its text: text parts joined by newlines, each image part
        the model's placeholder text (its `ImageRef` added to ``images``); a model that
        takes no images refuses an image part (400 naming it and the model)."""
        for k, part in enumerate(parts):
            at = f"{where}[{k}]"
            if part.type not in ("text", "image_url"):
                raise validation_error(f"`{at}` has type {part.type!r}: only \"text\" and \"image_url\" parts are "
                                       "supported", f"{at}.type")
            if part.type == "text" and part.text is None:
                raise validation_error(f"`{at}` is a text part without `text`", f"{at}.text")
        if all(part.type == "text" for part in parts):
            return "\n".join(part.text for part in parts)  # type: ignore[misc]
        media = self.service.media
        try:
            text, refs = join_openai_parts(parts, media.image_text, where, self.service.info.model_id)
        except MediaError as exc:
            raise media.error(relocated(exc, places)) from None
        images += [replace(ref, where=(places or {}).get(ref.where, ref.where)) for ref in refs]
        return text

    async def _chat_events(
        self, reply: Reply, job: Job, setup: ToolSetup, outputs: AsyncIterator
    ) -> AsyncIterator[bytes]:
        num_choices = job.params.n
        for index in range(num_choices):
            yield reply.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
        num_tokens = 0  # every choice's generated tokens, for usage
        num_top = job.params.logprobs
        pending = [Pending() for _ in range(num_choices)]  # tokens whose logprobs are not sent yet

        def logprobs_of(index: int, out: RequestOutput) -> dict | None:
            view = pending[index].take(out)
            if num_top is None or not view.outputs[0].token_ids:
                return None
            return chat_logprobs(self.service, view, 0, num_top).model_dump()

        reasoning_cls = self._reasoning_parser()
        readers = [AnswerReader(reasoning_cls, setup.parser) for _ in range(num_choices)]
        has_calls = [False] * num_choices

        def delta_of(index: int, out: RequestOutput) -> dict:
            """The chunk's delta: the text, or what the choice's parsers can report of it
            (the reasoning parser first, the tool parser reads what follows the reasoning)."""
            reasoning, content, calls = readers[index].feed(out.new_text, out.finished)
            delta: dict = {"content": content} if content else {}
            if reasoning:
                delta = {"reasoning_content": reasoning, **delta}
            pieces = tool_call_pieces(calls, setup.max_calls) if calls else []
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

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
