"""Mistral's tool calls (v0.3 tokenizer format): ``[TOOL_CALLS]`` and then a JSON list of
calls, ``[{"name": ..., "arguments": {...}}, ...]``, to the end of the answer; text before
the marker is content, and a marker followed by no call with a name stays content.

Read for templates that write ``[TOOL_CALLS]`` (Mistral 7B Instruct v0.3, Mistral Nemo,
Mistral Small).
"""

from __future__ import annotations

import json
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import JsonToolCallParser

MARKER = "[TOOL_CALLS]"


class MistralToolParser(JsonToolCallParser):
    name = "mistral"
    start_markers = (MARKER,)

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return MARKER in chat_template

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Mistral's ``[AVAILABLE_TOOLS]`` block, as its v0.3 template renders it."""
        return f"[AVAILABLE_TOOLS]{json.dumps(tools)}[/AVAILABLE_TOOLS]"

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return MARKER + json.dumps(objects)


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(MistralToolParser.name, MistralToolParser)
