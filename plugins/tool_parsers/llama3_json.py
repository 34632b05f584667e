"""Llama 3.1/3.2's JSON tool calls: the answer is the call, ``{"name": ...,
"parameters": {...}}`` (several separated by ``;``), optionally after
``<|python_tag|>``; an answer that starts with anything else is content.

Read for templates with Llama 3's header tokens (``<|start_header_id|>``).
"""

from __future__ import annotations

import json
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import JsonToolCallParser


class Llama3JsonToolParser(JsonToolCallParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    json_at_start = True

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "<|start_header_id|>" in chat_template

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Llama 3.1's prompt for JSON calls (its template's, when tools are in the user turn)."""
        signatures = "\n\n".join(json.dumps(tool) for tool in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            f"value}}. Do not use variables.\n\n{signatures}"
        )

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c["function"]["name"], "parameters": c["function"]["arguments"]}) for c in calls
        )


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(Llama3JsonToolParser.name, Llama3JsonToolParser)
