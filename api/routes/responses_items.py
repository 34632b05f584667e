"""The Responses API's items, both ways: a request's input items (and tools, tool
choice, text format) as the chat request the chat route runs, and a generated answer
as output items (`reasoning`, `message`, `function_call`).

Every input item is checked on its own, so a malformed one is a 400 naming it
(`input[2].call_id`); `input_image` parts become chat's `image_url` parts (a model that
takes no images refuses them on the chat path, naming the part); what Ember cannot take
(files, audio, built-in tools and their calls, item references) is a 400 naming the item,
never skipped. `reasoning`
items sent back are skipped on purpose: chat templates leave earlier turns' reasoning
out of the prompt.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from ember.api.errors import APIError, bad_request, from_validation_error
from ember.api.schemas import responses as rs

# a request field (or value) Ember refuses -> why
REFUSED_VALUES = {
    "background": "background responses (Ember answers every request in its connection)",
    "include": "`include` values (Ember fills no optional output: no logprobs, no encrypted reasoning)",
    "truncation": 'truncation "auto" (a conversation that does not fit is a 422; Ember never drops items)',
    "reasoning": "reasoning settings (effort and summaries cannot be steered; with --reasoning-parser the "
                 "reasoning text comes back as a `reasoning` item)",
}
PART_TYPES = ("input_text", "output_text", "refusal", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_refused(data: dict[str, Any]) -> None:
    """400 naming a field of the Responses API that Ember cannot honour (before the schema:
    the message says why, not only that the value is wrong)."""
    for name, what in rs.UNSUPPORTED_FIELDS.items():
        if data.get(name) is not None:
            raise bad_request(f"`{name}` ({what}) is not supported by Ember; remove it from the request", name)
    reasoning = data.get("reasoning")
    refused = {
        "background": bool(data.get("background")),
        "include": bool(data.get("include")),
        "truncation": data.get("truncation") == "auto",
        "reasoning": isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()),
    }
    for name, is_refused in refused.items():
        if is_refused:
            raise bad_request(f"`{name}`: {REFUSED_VALUES[name]} is not supported by Ember", name)
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            built_in = kind in rs.BUILT_IN_TOOLS or (isinstance(kind, str) and kind.startswith("web_search"))
            why = "built-in tools are not supported by Ember" if built_in else 'only "function" tools are supported'
            raise bad_request(f"`tools[{i}].type` is {kind!r}: {why}", f"tools[{i}].type")


def _checked(model: type[BaseModel], value: Any, where: str) -> Any:
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as exc:
        err = from_validation_error(exc)
        raise bad_request(f"`{where}`: {err.message}", f"{where}.{err.param}" if err.param else where) from None


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An `input_image` part as chat's `image_url` part; a 400 naming the field for a
    `file_id` (Ember has no files API) or a part without `image_url`."""
    checked = _checked(rs.ImagePart, part, where)
    if checked.file_id is not None:
        raise bad_request(f"`{where}.file_id`: file_id is not supported: send image_url (a data: URL, or an "
                          "http(s):// or file:// URL the server allows)", f"{where}.file_id")
    if checked.image_url is None:
        raise bad_request(f"`{where}` is an input_image part without `image_url`", f"{where}.image_url")
    detail = {"detail": checked.detail} if checked.detail is not None else {}
    return {"type": "image_url", "image_url": {"url": checked.image_url, **detail}}


def _parts(parts: list[dict[str, Any]], where: str, images: bool = True) -> tuple[str | list[dict[str, Any]], dict]:
    """Parts as chat content: their text joined by newlines, or with an image among them
    chat's text and `image_url` parts; and each image part's index -> its place here. A
    file or audio part (an image where ``images`` is False) is a 400 naming it."""
    texts: list[str] = []
    chat_parts: list[dict[str, Any]] = []
    sources: dict[int, str] = {}
    for k, part in enumerate(parts):
        at = f"{where}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            sources[len(chat_parts)] = at
            chat_parts.append(_image_part(part, at))
            continue
        if kind not in PART_TYPES:
            allowed = "text parts (input_text, output_text)" + (" and input_image parts" if images else "")
            raise bad_request(f"`{at}.type` is {kind!r}: only {allowed} are supported", f"{at}.type")
        checked = _checked(rs.TextPart, part, at)
        text = checked.refusal if checked.type == "refusal" else checked.text
        if text is None:
            field = "refusal" if checked.type == "refusal" else "text"
            raise bad_request(f"`{at}` is a {checked.type} part without `{field}`", f"{at}.{field}")
        texts.append(text)
        chat_parts.append({"type": "text", "text": text})
    return (chat_parts if sources else "\n".join(texts)), sources


def check_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as checked items (a string is one user message), as they will be stored."""
    if isinstance(items, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "content": items}]
    checked = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        model = {"message": rs.MessageItem, "function_call": rs.FunctionCallItem,
                 "function_call_output": rs.FunctionCallOutputItem, "reasoning": rs.ReasoningItem}.get(kind)
        if model is None:
            raise bad_request(f"`{where}.type` is {kind!r}: Ember supports message, function_call, "
                              "function_call_output and reasoning items", f"{where}.type")
        value = _checked(model, item, where)
        if kind == "message" and not isinstance(value.content, str):
            _parts(value.content, f"{where}.content")
        if kind == "function_call":
            try:
                arguments = json.loads(value.arguments) if value.arguments.strip() else {}
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise bad_request(f"`{where}.arguments` must be a JSON object's text, got {value.arguments[:200]!r}",
                                  f"{where}.arguments")
        dumped = value.model_dump(exclude_none=True, by_alias=True, exclude={"parsed_arguments"})
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
        checked.append({"id": new_id(prefix), "type": kind, **dumped})  # an id the item came with is kept
    return checked


def chat_messages(items: list[dict[str, Any]], instructions: str | None, places: dict[str, str] | None = None
                  ) -> list[dict[str, Any]]:
    """Checked items as chat messages: function calls join the assistant message before
    them (or make one), each output is a `tool` message; reasoning items are skipped.
    ``places``: filled with each chat image part -> its input part (named by errors)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            content, sources = item["content"], {}
            if not isinstance(content, str):
                content, sources = _parts(content, f"input[{i}].content")
            for k, at in sources.items():
                if places is not None:
                    places[f"messages[{len(messages)}].content[{k}]"] = at
            messages.append({"role": "system" if item["role"] == "developer" else item["role"], "content": content})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else _parts(output, f"input[{i}].output", images=False)[0]
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    if not messages:
        raise bad_request("`input` holds no message, function call or function call output", "input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}`."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        function = _checked(rs.FunctionTool, tool, f"tools[{i}]").model_dump(exclude_none=True)
        function.pop("type")
        function.pop("strict", None)
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`{"type": "function", "name"}` as chat's `{"type": "function", "function": {"name"}}`."""
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in ("none", "auto", "required"):
            raise bad_request(f'`tool_choice` must be "none", "auto", "required" or {{"type": "function", '
                              f'"name": ...}}, got {choice!r}'[:300], "tool_choice")
        return choice
    kind = choice.get("type")
    name = choice.get("name")
    if kind != "function" or not isinstance(name, str) or not name or set(choice) - {"type", "name"}:
        why = "built-in tools are not supported by Ember" if kind != "function" else "it needs a function `name`"
        raise bad_request(f"`tool_choice` {json.dumps(choice)[:200]}: {why}", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def response_format(text: rs.TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (the same grammar backends)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request('`text.format` of type "json_schema" needs `schema`', "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "schema", "schema": fmt.schema_}}


CHAT_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def renamed(exc: APIError) -> APIError:
    """A chat route error about a chat field, naming the Responses field instead."""
    message, param = exc.message, exc.param
    for chat_name, name in CHAT_NAMES.items():
        message = message.replace(f"`{chat_name}", f"`{name}")
        if param is not None and (param == chat_name or param.startswith(chat_name + "[")):
            param = name + param[len(chat_name):]
    return APIError(exc.status, message, exc.error_type, param)


# -- output items -------------------------------------------------------------------------


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def as_input_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item a continuation reads (the stored conversation)."""
    if item["type"] == "message":
        return {"id": item["id"], "type": "message", "role": "assistant", "content": item["content"][0]["text"]}
    if item["type"] == "function_call":
        return {key: item[key] for key in ("id", "type", "call_id", "name", "arguments")}
    return {"id": item["id"], "type": "reasoning", "summary": []}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as `GET /v1/responses/{id}/input_items` lists it (OpenAI's item shapes)."""
    listed = {"status": "completed", **item}
    if item["type"] == "message" and isinstance(item["content"], str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        part = {"type": kind, "text": item["content"], **({"annotations": []} if kind == "output_text" else {})}
        listed["content"] = [part]
    return listed


def page(listed: list[dict[str, Any]], query: dict[str, str]) -> tuple[list[dict[str, Any]], bool]:
    """One page of listed items for the query's `order` (desc by default), `limit` and `after`,
    and whether more follow; a 400 naming a bad parameter."""
    unknown = sorted(set(query) - {"order", "limit", "after"})
    if unknown:
        raise bad_request(f"query parameter `{unknown[0]}` is not supported (order, limit, after are)", unknown[0])
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f'`order` must be "asc" or "desc", got {order[:50]!r}', "order")
    text = query.get("limit", "20")
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 100):
        raise bad_request(f"`limit` must be an integer from 1 to 100, got {text[:50]!r}", "limit")
    ordered = listed[::-1] if order == "desc" else listed
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise bad_request(f"`after` names no input item of this response: {query['after'][:100]!r}", "after")
        start = ids.index(query["after"]) + 1
    end = start + int(text)
    return ordered[start:end], end < len(ordered)
