"""Mistral's tool calls (v0.3 tokenizer format): ``[TOOL_CALLS]`` and then a JSON list of
calls, ``[{"name": ..., "arguments": {...}}, ...]``, to the end of the answer; text before
the marker is content, and a marker followed by no call with a name stays content.

The newer form (Mistral's v11 tokenizer: Mistral Small 3.1+, Magistral, Devstral) is read
too: ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call.

Read for templates that write ``[TOOL_CALLS]`` (Mistral 7B Instruct v0.3, Mistral Nemo,
Mistral Small).
"""

from __future__ import annotations

import json
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import JsonToolCallParser, ToolCallDelta, _scan_object, new_call_id

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(JsonToolCallParser):
    name = "mistral"
    start_markers = (MARKER,)

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return MARKER in chat_template

    def _report(self, region: str, pieces: list[ToolCallDelta], is_final: bool) -> None:
        if not region.strip() or region.lstrip()[0] in "[{":
            super()._report(region, pieces, is_final)  # the v0.3 JSON list
            return
        for k, segment in enumerate(region.split(MARKER)):  # the v11 form: name[ARGS]{...} per marker
            index = self._region_first_call + k
            at = segment.find(ARGS)
            if at < 0:
                return
            name = segment[:at].strip()
            if not name or any(ch.isspace() or ch in "[]{}\"" for ch in name):
                return
            if index == len(self._calls):
                self._calls.append([new_call_id(), name, 0])
                pieces.append(ToolCallDelta(index, self._calls[index][0], name))
            arguments = segment[at + len(ARGS) :].lstrip()
            if not arguments.startswith("{"):
                if is_final or k < len(region.split(MARKER)) - 1:
                    self._send(index, "{}", pieces)
                continue
            _, end = _scan_object(arguments)
            self._send(index, arguments[:end] if end is not None else arguments.rstrip(), pieces)

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Mistral's ``[AVAILABLE_TOOLS]`` block, as its v0.3 template renders it."""
        return f"[AVAILABLE_TOOLS]{json.dumps(tools)}[/AVAILABLE_TOOLS]"

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return MARKER + json.dumps(objects)


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(MistralToolParser.name, MistralToolParser)
