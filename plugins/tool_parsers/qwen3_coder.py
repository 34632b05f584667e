"""Qwen3-Coder's XML tool calls: each call between ``<tool_call>`` and ``</tool_call>``,
``<function=NAME>`` holding ``<parameter=KEY>VALUE</parameter>`` entries and closed by
``</function>``; a value (one newline trimmed at each end) is read as JSON when it is valid
JSON, else kept as a string; the arguments are a JSON object. Text around calls is
content; a ``<tool_call>`` region that is not one such function stays content, tags and
all. Each call is reported whole once its ``</tool_call>`` (or the answer's end) comes.

Read for templates that write ``<function=`` and ``<parameter=`` (Qwen3-Coder).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import BaseToolParser, ParserDelta, ToolCallDelta, _partial_suffix, new_call_id

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^<>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^<>\n]+)>(.*?)</parameter>", re.DOTALL)


def _value(text: str) -> Any:
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_function(region: str) -> tuple[str, dict[str, Any]] | None:
    """The call a ``<tool_call>`` region holds, or None."""
    match = _FUNCTION.fullmatch(region)
    if match is None:
        return None
    name, body = match.group(1).strip(), match.group(2)
    arguments: dict[str, Any] = {}
    at = 0
    for parameter in _PARAMETER.finditer(body):
        key = parameter.group(1).strip()
        if body[at : parameter.start()].strip() or key in arguments:
            return None
        arguments[key] = _value(parameter.group(2))
        at = parameter.end()
    if body[at:].strip() or not name:
        return None
    return name, arguments


def _written(value: Any) -> str:
    """A value as the template writes it: strings bare unless they would read as JSON."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value)


class Qwen3CoderToolParser(BaseToolParser):
    name = "qwen3_coder"

    def __init__(self) -> None:
        self._held = ""
        self._region: str | None = None  # the open region's text after <tool_call>
        self._calls = 0

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "<function=" in chat_template and "<parameter=" in chat_template

    def feed(self, text: str) -> ParserDelta:
        self._held += text
        content: list[str] = []
        pieces: list[ToolCallDelta] = []
        while True:
            if self._region is None:
                at = self._held.find(START)
                if at >= 0:
                    content.append(self._held[:at])
                    self._region, self._held = "", self._held[at + len(START) :]
                    continue
                keep = _partial_suffix(self._held, (START,))
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            end = self._held.find(END)
            if end < 0:
                break
            region, self._held = self._held[:end], self._held[end + len(END) :]
            content.append(self._close(region, END, pieces))
        return ParserDelta("".join(content), tuple(pieces))

    def _close(self, region: str, closing: str, pieces: list[ToolCallDelta]) -> str:
        self._region = None
        call = parse_function(region)
        if call is None:
            return START + region + closing
        pieces.append(ToolCallDelta(self._calls, new_call_id(), call[0], json.dumps(call[1])))
        self._calls += 1
        return ""

    def finish(self) -> ParserDelta:
        rest, self._held = self._held, ""
        if self._region is None:
            return ParserDelta(rest)
        pieces: list[ToolCallDelta] = []
        content = self._close(rest, "", pieces)
        return ParserDelta(content, tuple(pieces))

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Qwen3-Coder's tool prompt, shortened."""
        signatures = "\n".join(json.dumps(tool) for tool in tools)
        return (
            "# Tools\n\nYou have access to the following functions:\n\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n</function>\n</tool_call>"
        )

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        written = []
        for call in calls:
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            parameters = "".join(
                f"<parameter={key}>\n{_written(value)}\n</parameter>\n" for key, value in arguments.items()
            )
            written.append(f"{START}\n<function={call['function']['name']}>\n{parameters}</function>\n{END}")
        return "\n".join(written)


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(Qwen3CoderToolParser.name, Qwen3CoderToolParser)
