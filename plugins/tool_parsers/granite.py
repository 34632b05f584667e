"""IBM Granite 3.x tool calls: ``<|tool_call|>`` and then a JSON list of calls,
``[{"name": ..., "arguments": {...}}, ...]``, to the end of the answer; text before the
marker is content, and a marker followed by no call with a name stays content.

Read for templates that write ``<|tool_call|>`` (Granite 3.0-3.3 instruct).
"""

from __future__ import annotations

import json
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import JsonToolCallParser

MARKER = "<|tool_call|>"


class GraniteToolParser(JsonToolCallParser):
    name = "granite"
    start_markers = (MARKER,)

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return MARKER in chat_template

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Granite 3's tool system text."""
        signatures = "\n\n".join(json.dumps(tool, indent=4) for tool in tools)
        return (
            "You are a helpful assistant with access to the following function calls. Your task is to produce a "
            "list of function calls necessary to generate response to the user utterance. Use the following "
            f"function calls as required.\n\n{signatures}\n\n"
            f'To call functions, answer with {MARKER}[{{"name": <function-name>, "arguments": <args-json-object>}}]'
        )

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return MARKER + json.dumps(objects)


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(GraniteToolParser.name, GraniteToolParser)
