"""Tools on a chat: checking them, forcing a call with a grammar, and putting tools,
calls and results through the chat template. Shared by the HTTP chat route and
``LLM.chat``.

* ``tool_choice``: ``"none"`` (tools are not shown to the model), ``"auto"`` (the
  model chooses; the parser reads its answer), ``"required"`` and a named function
  (``{"type": "function", "function": {"name": ...}}``) force a call through a grammar:
  the answer is a JSON call object ``{"name": ..., "arguments": {...}}`` (a list of
  them when parallel calls are allowed) whose arguments follow the function's
  ``parameters`` schema, read by `ForcedToolCallParser`.
* A chat template that renders tools itself (it names ``tools``, as Qwen2.5's and
  Llama 3.1's do) gets them as ``apply_chat_template(..., tools=...)``; for one that
  does not (SmolLM2's), the parser's `tool_prompt` goes into the system message and
  earlier assistant calls are written in the parser's syntax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.constraint import Constraint
from ember.plugin.registry import Registry
from ember.plugin.tool_parser import BaseToolParser, ForcedToolCallParser


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """A chat's tools, checked. ``forced``: the grammar holding the answer to a call
    (None with ``auto``); ``parser``: the class that reads the answer (None when no
    call can come)."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # "none", "auto", "required" or "function"
    forced: Constraint | None
    parser: type[BaseToolParser] | None
    max_calls: int | None = None  # 1 when parallel calls are off, else no limit


NO_TOOLS = ToolSetup((), "none", None, None)  # a chat without tools


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools`` list: ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`` entries with distinct names; ValueError naming the bad one."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {tools!r}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}, got {tool!r}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, got {name!r}")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is used by an earlier tool")
        names.add(name)
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got {parameters!r}")
    return tools


def resolve_choice(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[str, str | None]:
    """(``none`` | ``auto`` | ``required`` | ``function``, the named function or None).
    The default is ``auto`` with tools and ``none`` without; ValueError for a choice
    without tools or naming no given tool."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs `tools`")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {tool_choice!r}"
        )
    known = [tool["function"]["name"] for tool in tools]
    if name not in known:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in `tools` ({', '.join(known) or 'none'})")
    return "function", name


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_constraint(tools: list[dict[str, Any]], choice: str, name: str | None, parallel: bool) -> Constraint:
    """The grammar of a forced answer: the named function's call, or (``required``) a
    call of any tool; a non-empty list of calls when ``parallel``."""
    if choice == "function":
        one = _call_schema(next(tool for tool in tools if tool["function"]["name"] == name))
    else:
        schemas = [_call_schema(tool) for tool in tools]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return Constraint.json_schema({"type": "array", "items": one, "minItems": 1} if parallel else one)


def select_tool_parser(
    registry: Registry, chat_template: str | None, name: str | None = None,
) -> type[BaseToolParser] | None:
    """The parser named by ``name`` (``--tool-call-parser``; ValueError for one not
    registered), else the first registered parser (by name) that reads this template's
    syntax."""
    if name is not None:
        if name not in registry:
            raise ValueError(f"tool-call parser {name!r} is not registered; registered: {', '.join(registry.names()) or 'none'}")
        return registry.get(name)
    if not chat_template:
        return None
    for name in registry.names():
        cls = registry.get(name)
        if cls.matches_template(chat_template):
            return cls
    return None


def setup_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, registry: Registry, chat_template: str | None,
    parser_name: str | None = None,
) -> ToolSetup:
    """Check a chat's tools and choice; ValueError naming the problem (a choice naming
    no tool, ``auto`` for a model no parser reads). ``parser_name``: the parser that
    reads ``auto`` answers (``--tool-call-parser``) instead of the template's."""
    tools = check_tools(tools) if tools is not None else []
    choice, name = resolve_choice(tools, tool_choice)
    if choice == "none":
        return NO_TOOLS
    max_calls = 1 if parallel_tool_calls is False else None
    if choice == "auto":
        parser = select_tool_parser(registry, chat_template, parser_name)
        if parser is None:
            known = ", ".join(registry.names()) or "none"
            raise ValueError(
                f'tool_choice "auto" needs a tool-call parser for this model\'s chat template; none of the '
                f'registered ones ({known}) reads it. Use "required" or a named function (a grammar writes the call), '
                "or start the server with --tool-call-parser NAME"
            )
        return ToolSetup(tuple(tools), "auto", None, parser, max_calls)
    parallel = max_calls is None and choice == "required"
    constraint = forced_call_constraint(tools, choice, name, parallel)
    return ToolSetup(tuple(tools), choice, constraint, ForcedToolCallParser, max_calls)


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template places ``tools`` in the prompt itself."""
    return bool(chat_template) and "tools" in chat_template


def chat_messages(
    messages: list[dict[str, Any]], setup: ToolSetup, registry: Registry, chat_template: str | None,
    parser_name: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument to give the chat template. Assistant
    calls' arguments become objects (templates write them with ``tojson``); for a
    template that does not render tools, the tools are described in the system message
    and earlier calls are written in the model's syntax."""
    plain = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_with_object_arguments(call) for call in calls]
        if message.get("content") is None:
            message["content"] = ""
        plain.append(message)
    if renders_tools(chat_template):
        return plain, list(setup.tools) or None
    parser = select_tool_parser(registry, chat_template, parser_name) or ForcedToolCallParser
    writer = parser()
    for message in plain:
        calls = message.pop("tool_calls", None)
        if calls:
            message["content"] = "\n".join(part for part in (message["content"], writer.format_tool_calls(calls)) if part)
    if setup.tools:
        prompt = writer.tool_prompt(list(setup.tools))
        if plain[0]["role"] == "system":
            plain[0] = {**plain[0], "content": f"{plain[0]['content']}\n\n{prompt}"}
        else:
            plain.insert(0, {"role": "system", "content": prompt})
    return plain, None


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments", "")  # none given: no arguments
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"tool call {function.get('name')!r} has arguments that are not JSON: {arguments[:200]!r}") from None
    return {**call, "function": function}
