"""The Responses API's stored responses: what `GET /v1/responses/{id}` returns and what
`previous_response_id` continues, held in memory and bounded.

Each entry keeps the response object as sent and the conversation it ends: every input
item that led to it (earlier turns included, `instructions` excepted, as OpenAI) and
its output items, so a continuation needs only the one entry. Two bounds, both
`ember serve` flags: at most `max_entries` responses (the oldest stored leaves first;
0 turns storing off) and `ttl_s` seconds each. An entry past either bound is gone: its
id is then a 404 like an unknown one. Nothing is written to disk and a restart forgets
everything (documented in docs/api.md).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    conversation: tuple[dict[str, Any], ...]  # input items (all turns) then this response's output items
    model: str  # the `model` it ran under (a continuation on another adapter is allowed, as OpenAI)
    stored_at: float
    num_input: int  # the conversation's first items: the input the response answered


class ResponsesStore:
    """A bounded, thread-safe map of response id -> `StoredResponse` (least recently
    stored first out; reading does not refresh an entry's age)."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], model: str, num_input: int) -> None:
        """Keep ``response`` (a no-op when storing is off), evicting expired then oldest entries."""
        if not self.is_enabled:
            return
        entry = StoredResponse(response, tuple(conversation), model, self._clock(), num_input)
        with self._lock:
            self._entries[response["id"]] = entry
            self._entries.move_to_end(response["id"])
            self._expire()
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when unknown, evicted or expired."""
        with self._lock:
            self._expire()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Whether the id was stored (and is now gone)."""
        with self._lock:
            self._expire()
            return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop entries older than the TTL (the oldest are first: stop at the first young one)."""
        deadline = self._clock() - self.ttl_s
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > deadline:
                return
            del self._entries[oldest_id]
