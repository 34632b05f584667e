"""The Responses API's streamed events, as OpenAI sends them: each a server-sent event
with an ``event:`` line naming its ``type`` and a ``sequence_number`` counting from 0.

One `EventWriter` follows one streamed response. The route feeds it what the parsers
read from each engine output (reasoning text, answer text, tool-call pieces); the
writer opens and closes output items around them, so the order is always:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta..., .done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta..., .done, response.content_part.done
      function_call: response.function_call_arguments.delta..., .done
    response.output_item.done,
    response.completed | response.incomplete (or error + response.failed)

The items it writes are the response's `output`, the same as the unstreamed answer's.
"""

from __future__ import annotations

import json
from typing import Any

from ember.api.routes.responses_items import function_call_item, message_item, reasoning_item


def sse(name: str, payload: dict[str, Any]) -> bytes:
    """One event with its ``event:`` line (strict JSON: NaN never leaks)."""
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


class EventWriter:
    def __init__(self) -> None:
        self.num_events = 0
        self.output: list[dict[str, Any]] = []  # items done or open, in output order
        self._open: dict[str, Any] | None = None  # the item being written, the last of `output`

    def event(self, name: str, /, **fields: Any) -> bytes:
        payload = {"type": name, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return sse(name, payload)

    def start(self, response: dict[str, Any]) -> list[bytes]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def end(self, response: dict[str, Any]) -> bytes:
        name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed")
        return self.event(name, response=response)

    def error(self, message: str, code: str, param: str | None) -> bytes:
        return self.event("error", code=code, message=message, param=param)

    # -- items ---------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _add(self, item: dict[str, Any], empty: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.output.append(item)
        self._open = item
        return [*events, self.event("response.output_item.added", output_index=self._index, item=empty)]

    def reasoning(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != "reasoning":
            item = reasoning_item("", "in_progress")
            events += self._add(item, {**item, "content": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                     content_index=0, part={"type": "reasoning_text", "text": ""}))
        item = self._open
        item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self._index,
                                 content_index=0, delta=text))
        return events

    def text(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != "message":
            item = message_item("", "in_progress")
            events += self._add(item, {**item, "content": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                     content_index=0, part={**item["content"][0]}))
        item = self._open
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._index,
                                 content_index=0, delta=text, logprobs=[]))
        return events

    def call(self, call_id: str, name: str) -> list[bytes]:
        item = function_call_item(call_id, name, "", "in_progress")
        return self._add(item, dict(item))

    def arguments(self, piece: str) -> list[bytes]:
        item = self._open
        item["arguments"] += piece
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self._index,
                           delta=piece)]

    def close(self, status: str = "completed") -> list[bytes]:
        """Finish the open item (with ``status``), if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = self._index, []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done", {}) if item["type"] == "reasoning" else (
                "response.output_text.done", {"logprobs": []})
            events.append(self.event(done[0], item_id=item["id"], output_index=index, content_index=0,
                                     text=part["text"], **done[1]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events
