"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on the chat path.

A request becomes the OpenAI chat request it means (`chat_request`): ``system`` the first
message, ``text`` blocks a message's text, a user's ``image`` blocks (base64 or url
sources, for a model that takes images) its image parts, an assistant's ``tool_use``
blocks its tool calls, a user's ``tool_result`` blocks tool messages; ``tools`` function tools and
``tool_choice`` auto / any / tool / none the chat's auto / required / named function /
none. That request then runs through `ChatRoutes` (the chat template with tools, the
tool-call parser, forced calls by grammar), and the answer is written back as text and
``tool_use`` blocks, streamed with Anthropic's event sequence; with --reasoning-parser the
reasoning comes first as a ``thinking`` block (``thinking_delta`` events, an empty
signature), unless ``thinking`` is disabled. Earlier turns' thinking blocks are accepted
and left out of the prompt. Errors have Anthropic's shape (`Flavor.ANTHROPIC`); a
malformed request is a 400 naming the field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import (
    APIError,
    Flavor,
    bad_request,
    error_body,
    error_response,
    from_validation_error,
    note_error,
)
from ember.api.http import parse_model, read_json
from ember.api.openapi import GENERATION_ERRORS, documented
from ember.api.routes.media import NeedsMedia, complete
from ember.api.routes.openai import AnswerReader, Job
from ember.api.routes.openai_chat import ChatRoutes
from ember.api.schemas import anthropic as an
from ember.api.schemas import openai as oa
from ember.api.structured_outputs import failure
from ember.engine.tool_calls import NO_TOOLS, ToolSetup
from ember.outputs import RequestOutput
from ember.plugin.reasoning_parser import BaseReasoningParser

BLOCK_TYPES = {"user": ("text", "tool_result", "image"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # what Anthropic's image blocks take
THINKING_BLOCKS = {"thinking": an.ThinkingBlock, "redacted_thinking": an.RedactedThinkingBlock}


def event(name: str, payload: dict) -> bytes:
    """One server-sent event with Anthropic's ``event:`` line."""
    return f"event: {name}\ndata: {json.dumps(payload, allow_nan=False)}\n\n".encode()


def _block(model: type[BaseModel], block: dict, where: str) -> Any:
    try:
        return model.model_validate(block, strict=True)
    except ValidationError as exc:
        err = from_validation_error(exc)
        raise bad_request(f"`{where}`: {err.message}", f"{where}.{err.param}" if err.param else where) from None


def _text(content: str | list[an.TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def image_url_of(block: dict, where: str) -> str:
    """An image block's source as the URL the chat path loads (base64 data as a data: URL);
    a 400 naming the field for a malformed source or a media type Anthropic's API refuses."""
    source = _block(an.ImageBlock, block, where).source
    at = f"{where}.source"
    kind = source.get("type")
    if kind == "base64":
        checked = _block(an.Base64ImageSource, source, at)
        if checked.media_type not in IMAGE_MEDIA_TYPES:
            raise bad_request(f"`{at}.media_type` is {checked.media_type[:100]!r}: image blocks take "
                              f"{', '.join(IMAGE_MEDIA_TYPES)}", f"{at}.media_type")
        return f"data:{checked.media_type};base64,{checked.data}"
    if kind == "url":
        return _block(an.URLImageSource, source, at).url
    raise bad_request(f'`{at}.type` is {str(kind)[:100]!r}: an image source is "base64" or "url"', f"{at}.type")


def chat_messages_of(body: an.CountTokensRequest, places: dict[str, str] | None = None,
                     check_image: Callable[[str], None] | None = None) -> list[dict]:
    """The request's system prompt and messages as OpenAI chat messages; an image block
    becomes an `image_url` part (``check_image(where)`` first: a 400 for a model that
    takes no images), and ``places`` maps that part to the block's source."""
    messages: list[dict] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        parts: list[tuple[dict, str | None]] = []  # a user message's text and image parts, each image's source
        calls: list[dict] = []
        num_results = 0
        for k, block in enumerate(message.content):
            where = f"messages[{i}].content[{k}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES[message.role]:
                allowed = " and ".join(repr(t) for t in BLOCK_TYPES[message.role])
                raise bad_request(f"`{where}.type` is {kind!r}: Ember supports only {allowed} blocks in a "
                                  f"{message.role} message (no documents)", f"{where}.type")
            if kind in THINKING_BLOCKS:  # earlier thinking stays out of the prompt, as in Anthropic's API
                _block(THINKING_BLOCKS[kind], block, where)
            elif kind == "image":
                if check_image is not None:
                    check_image(where)
                url = image_url_of(block, where)
                parts.append(({"type": "image_url", "image_url": {"url": url}}, f"{where}.source"))
            elif kind == "text":
                texts.append(_block(an.TextBlock, block, where).text)
                parts.append(({"type": "text", "text": texts[-1]}, None))
            elif kind == "tool_use":
                use = _block(an.ToolUseBlock, block, where)
                calls.append({"id": use.id, "type": "function",
                              "function": {"name": use.name, "arguments": json.dumps(use.input)}})
            else:
                result = _block(an.ToolResultBlock, block, where)
                text = _text(result.content)
                num_results += 1
                messages.append({"role": "tool", "tool_call_id": result.tool_use_id,
                                 "content": f"Error: {text}" if result.is_error else text})
        if message.role == "assistant":
            entry = {"role": "assistant", "content": "\n".join(texts)}
            messages.append({**entry, "tool_calls": calls} if calls else entry)
        elif len(parts) > len(texts):  # images among the text: the parts, each image's source named
            for k, (_, source) in enumerate(parts):
                if source is not None and places is not None:
                    places[f"messages[{len(messages)}].content[{k}]"] = source
            messages.append({"role": "user", "content": [part for part, _ in parts]})
        elif texts or not num_results:
            messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def chat_request(body: an.CountTokensRequest, places: dict[str, str] | None = None,
                 check_image: Callable[[str], None] | None = None) -> oa.ChatCompletionRequest:
    """The OpenAI chat request an Anthropic request means (``places``, ``check_image``:
    `chat_messages_of`)."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages_of(body, places, check_image)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {})}} for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise bad_request('`tool_choice.name` is required with type "tool"', "tool_choice.name")
        if choice.type != "tool" and choice.name is not None:
            raise bad_request(f'`tool_choice.name` is only allowed with type "tool", not {choice.type!r}',
                              "tool_choice.name")
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, an.MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream)
    try:
        return oa.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        err = from_validation_error(exc)
        raise bad_request(err.message, err.param) from None


def stop_reason(out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    completion = out.outputs[0]
    if completion.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


class MessagesRoutes(ChatRoutes):
    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def _read(self, request: Request, model: type[an.CountTokensRequest]) -> an.CountTokensRequest:
        """The body, with Anthropic's statuses: a field Ember cannot honour, or a malformed one, is a 400."""
        data = await read_json(request)
        if isinstance(data, dict):
            for name, what in an.UNSUPPORTED_FIELDS.items():
                if name in data:
                    raise bad_request(f"`{name}` ({what}) is not supported by Ember; remove it from the request", name)
        try:
            return parse_model(model, data)
        except APIError as exc:
            raise bad_request(exc.message, exc.param) from None

    @documented(summary="Messages (Anthropic)", tag="Anthropic", request=an.MessagesRequest,
                response=an.MessageResponse, streams=True, error_model=an.ErrorResponse, errors=GENERATION_ERRORS)
    async def messages(self, request: Request) -> Response:
        try:
            body = await self._read(request, an.MessagesRequest)
            job, setup = await complete(self.service, await self.service.run_blocking(self._messages_job, body))
            thinker = self._reasoning_parser() if self._shows_thinking(body) else None
            if body.stream:
                return await self._stream(lambda outs: self._message_events(body, job, setup, thinker, outs), [job])
            outs = await self._run(request, [job])
            if outs is not None and job.params.constraint is not None:
                self._check_failures(outs, [job])
        except APIError as exc:
            return error_response(exc, Flavor.ANTHROPIC)
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        text, reasoning = out.outputs[0].text, None
        if self._reasoning_parser() is not None:
            reasoning, text = self._reasoning_parser()().extract(text)
        content, has_calls = self._content(text, setup)
        if reasoning and thinker is not None:
            content.insert(0, {"type": "thinking", "thinking": reasoning, "signature": ""})
        reason, sequence = stop_reason(out, has_calls)
        return JSONResponse(an.MessageResponse(
            id=f"msg_{uuid.uuid4().hex}", model=body.model, content=content, stop_reason=reason,
            stop_sequence=sequence, usage=an.Usage(input_tokens=len(job.prompt_ids),
                                                   output_tokens=len(out.outputs[0].token_ids)),
        ).model_dump())

    @documented(summary="Count a Messages request's input tokens (Anthropic)", tag="Anthropic",
                request=an.CountTokensRequest, response=an.CountTokensResponse, error_model=an.ErrorResponse,
                errors=GENERATION_ERRORS)
    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await self._read(request, an.CountTokensRequest)
            num_tokens = await complete(self.service, await self.service.run_blocking(self._count, body))
        except APIError as exc:
            return error_response(exc, Flavor.ANTHROPIC)
        return JSONResponse({"input_tokens": num_tokens})

    def _count(self, body: an.CountTokensRequest) -> int | NeedsMedia[int]:
        """The templated prompt's tokens (tools included), as /v1/messages would send them
        (images counted as the tokens they expand to, once processed)."""
        self.service.adapter_for_model(body.model)
        self._shows_thinking(body)
        places: dict[str, str] = {}
        chat = chat_request(body, places, self._check_image)
        setup = self._tool_setup(chat) if chat.tools or chat.tool_choice is not None else NO_TOOLS
        prompt, images = self._chat_prompt(chat.messages, setup, places)
        ids = self.service.encode(prompt, add_special_tokens=False)
        return (NeedsMedia(ids, images, "messages", lambda expanded, _: len(expanded), prompt) if images
                else len(ids))

    def _check_image(self, where: str) -> None:
        """A 400 naming the block for an image sent to a model that takes none."""
        if self.service.media.image_text is None:
            raise self.service.media.no_images(where)

    def _shows_thinking(self, body: an.CountTokensRequest) -> bool:
        """Whether the answer carries the reasoning as ``thinking`` blocks (with
        --reasoning-parser, unless ``thinking`` is disabled); a 400 for a ``thinking``
        Ember cannot honour. Without a parser there is no reasoning to show."""
        thinking = body.thinking
        if thinking is not None and thinking.type == "disabled" and thinking.budget_tokens is not None:
            raise bad_request('`thinking.budget_tokens` is only allowed with type "enabled"', "thinking.budget_tokens")
        if thinking is not None and thinking.type == "enabled":
            if self._reasoning_parser() is None:
                raise bad_request("`thinking` needs a reasoning parser: start `ember serve` with --reasoning-parser NAME "
                                  "(docs/reasoning.md)", "thinking")
            if thinking.budget_tokens is None:
                raise bad_request('`thinking.budget_tokens` is required with type "enabled"', "thinking.budget_tokens")
            if isinstance(body, an.MessagesRequest) and thinking.budget_tokens >= body.max_tokens:
                raise bad_request(f"`thinking.budget_tokens` ({thinking.budget_tokens}) must be less than `max_tokens` "
                                  f"({body.max_tokens})", "thinking.budget_tokens")
        return self._reasoning_parser() is not None and (thinking is None or thinking.type == "enabled")

    def _messages_job(self, body: an.MessagesRequest) -> tuple[Job, ToolSetup] | NeedsMedia[tuple[Job, ToolSetup]]:
        self.service.adapter_for_model(body.model)  # a 404 before the messages are read
        stop = body.stop_sequences or []
        self.service.check_stop(stop, "stop_sequences")
        if any(not text for text in stop):
            raise bad_request("`stop_sequences` strings must be non-empty", "stop_sequences")
        places: dict[str, str] = {}
        chat = chat_request(body, places, self._check_image)
        if self._shows_thinking(body) and body.thinking is not None:  # enabled, with its budget
            parser = self._reasoning_parser()
            budget = {"budget": body.thinking.budget_tokens, "end": parser.end_tag}
            if not getattr(parser, "starts_in_reasoning", False):  # the model opens the tag itself
                budget["start"] = parser.start_tag
            chat = chat.model_copy(update={"extra": {"thinking_budget": budget}})
        return self._chat_job(chat, places)

    @staticmethod
    def _content(text: str, setup: ToolSetup) -> tuple[list[dict], bool]:
        """The answer as text and tool_use blocks (its calls read by the chat's parser)."""
        if setup.parser is None:
            return ([{"type": "text", "text": text}] if text else []), False
        parsed = setup.parser().parse(text)
        calls = parsed.tool_calls[: setup.max_calls]
        if not calls:
            return ([{"type": "text", "text": text}] if text else []), False
        blocks: list[dict] = [{"type": "text", "text": parsed.content}] if parsed.content else []
        blocks += [{"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                    "input": json.loads(call.arguments or "{}")} for call in calls]
        return blocks, True

    async def _message_events(
        self, body: an.MessagesRequest, job: Job, setup: ToolSetup, thinker: type[BaseReasoningParser] | None,
        outputs: AsyncIterator,
    ) -> AsyncIterator[bytes]:
        """Anthropic's event sequence. ``thinker``: the reasoning parser whose reasoning is
        streamed as a ``thinking`` block (None: no thinking blocks; with --reasoning-parser
        and thinking disabled the reasoning is still kept out of the text)."""
        yield event("message_start", {"type": "message_start", "message": {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(job.prompt_ids), "output_tokens": 0}}})
        yield event("ping", {"type": "ping"})
        reader = AnswerReader(self._reasoning_parser(), setup.parser)  # reasoning first, then text and calls
        blocks: list[str] = []  # the kind of each block started; the last one is open until stopped
        is_open = False
        num_tokens, has_calls, last = 0, False, None

        def start(block: dict) -> list[bytes]:
            nonlocal is_open
            events = [stop_block()] if is_open else []
            blocks.append(block["type"])
            is_open = True
            return [*events, event("content_block_start", {"type": "content_block_start", "index": len(blocks) - 1,
                                                            "content_block": block})]

        def stop_block() -> bytes:
            nonlocal is_open
            is_open = False
            stop = event("content_block_stop", {"type": "content_block_stop", "index": len(blocks) - 1})
            return delta({"type": "signature_delta", "signature": ""}) + stop if blocks[-1] == "thinking" else stop

        def delta(payload: dict) -> bytes:
            return event("content_block_delta", {"type": "content_block_delta", "index": len(blocks) - 1,
                                                  "delta": payload})

        async with aclosing(outputs) as outs:
            async for _, out in outs:
                error = failure(out, job.constraint_param) if out.outputs[0].finish_reason == "error" else None
                if error is not None:
                    raise error
                num_tokens += len(out.new_token_ids)
                last = out
                reasoning, content, calls = reader.feed(out.new_text, out.finished)
                if reasoning and thinker is not None:
                    if not (is_open and blocks[-1] == "thinking"):
                        for item in start({"type": "thinking", "thinking": "", "signature": ""}):
                            yield item
                    yield delta({"type": "thinking_delta", "thinking": reasoning})
                if content:
                    if not (is_open and blocks[-1] == "text"):
                        for item in start({"type": "text", "text": ""}):
                            yield item
                    yield delta({"type": "text_delta", "text": content})
                for piece in calls:
                    if setup.max_calls is not None and piece.index >= setup.max_calls:
                        continue
                    if piece.id is not None:
                        has_calls = True
                        for item in start({"type": "tool_use", "id": _tool_use_id(piece.id), "name": piece.name,
                                           "input": {}}):
                            yield item
                    if piece.arguments:
                        yield delta({"type": "input_json_delta", "partial_json": piece.arguments})
        if is_open:
            yield stop_block()
        reason, sequence = stop_reason(last, has_calls) if last is not None else ("end_turn", None)
        yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                         "stop_sequence": sequence},
                                      "usage": {"output_tokens": num_tokens}})
        yield event("message_stop", {"type": "message_stop"})

    async def _guarded(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Once the stream began, a failure is an ``error`` event in Anthropic's shape, then a clean end."""
        try:
            async with aclosing(events) as inner:
                async for item in inner:
                    yield item
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {exc!r}", "generation")
            note_error(error)
            yield event("error", error_body(error, Flavor.ANTHROPIC))
