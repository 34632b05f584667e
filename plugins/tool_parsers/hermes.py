"""Hermes-style tool calls, as Qwen2.5's template teaches them (and NousResearch's
Hermes 2 Pro before it): each call a JSON object between ``<tool_call>`` and
``</tool_call>``, ``{"name": ..., "arguments": {...}}``; text around them is content.

Read for templates that write ``<tool_call>`` and for ChatML templates
(``<|im_start|>``) without tools of their own: the ChatML family (SmolLM2 among them)
was tuned on this syntax.
"""

from __future__ import annotations

import json
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import JsonToolCallParser


class HermesToolParser(JsonToolCallParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        if "<function=" in chat_template and "<parameter=" in chat_template:
            return False  # Qwen3-Coder's XML calls (qwen3_coder)
        return "<tool_call>" in chat_template or "<|im_start|>" in chat_template

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Qwen2.5's own tool prompt."""
        signatures = "\n".join(json.dumps(tool) for tool in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f'<tool_call>\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}'
            "\n</tool_call>"
            for c in calls
        )


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(HermesToolParser.name, HermesToolParser)
