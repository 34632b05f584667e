"""The tool-call parser contract: a chat model's text turned into OpenAI ``tool_calls``.

Chat models call tools in the syntax their chat template taught them (Hermes'
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Llama 3's bare
``{"name": ..., "parameters": {...}}``). A parser is a :class:`BaseToolParser`
subclass registered by class through the ``ember_register_tool_parsers`` hook; the
server picks, once, the first registered parser whose `matches_template` accepts the
model's chat template (``ember.engine.tool_calls.select_tool_parser``).

One parser instance follows one generated answer: `feed` takes each new piece of text
and returns what can be reported now (plain content, and tool-call pieces), `finish`
flushes the rest. Invariants every parser keeps, whatever the split into pieces:

* the content and the tool calls reported over the whole answer are the same as for
  the whole text fed at once (`parse` is ``feed(text)`` then ``finish()``);
* a call's first piece carries its ``id`` and ``name``; ``arguments`` pieces follow and
  concatenate to its arguments' JSON text; calls are numbered from 0 in order;
* text that may still turn out to start a call is held back, never reported as content.

:class:`JsonToolCallParser` implements this for the common case (JSON call objects
between markers, or a whole answer that is JSON); both built-in parsers are it with
their markers. ``ember.testing.check_tool_parser`` checks a parser against these rules.
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ParserDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str | None  # None when the answer held nothing but tool calls
    tool_calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class BaseToolParser(abc.ABC):
    name: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def matches_template(cls, chat_template: str) -> bool:
        """Whether this parser reads what a model with this chat template writes."""

    @abc.abstractmethod
    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System text describing ``tools`` (OpenAI's ``{"type": "function", ...}``
        entries) and this syntax, for a chat template that does not render tools."""

    @abc.abstractmethod
    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant message's ``tool_calls`` (``{"function": {"name", "arguments"}}``,
        arguments a dict) written in this syntax, for such a template."""

    @abc.abstractmethod
    def feed(self, text: str) -> ParserDelta:
        """The next piece of generated text; what can be reported now."""

    @abc.abstractmethod
    def finish(self) -> ParserDelta:
        """The answer ended: everything still held."""

    def parse(self, text: str) -> ParsedMessage:
        """A whole answer at once (on a fresh parser)."""
        return assemble([self.feed(text), self.finish()])


def assemble(deltas: list[ParserDelta]) -> ParsedMessage:
    """The message that a list of deltas reports (as the openai SDK puts streams together)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in calls:
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    tool_calls = tuple(ToolCall(*calls[i]) for i in sorted(calls))
    return ParsedMessage(content if content.strip() or not tool_calls else None, tool_calls)


_KEY_NAME = "name"
_ARGUMENT_KEYS = ("arguments", "parameters")


def _scan_object(text: str) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level keys of the (possibly unfinished) JSON object ``text`` (which
    starts with ``{``), each with its value's (start, end) span (end None while the value
    is unfinished), and where the object ends (None if it does not yet)."""
    keys: dict[str, tuple[int, int | None]] = {}
    depth, i, n = 0, 0, len(text)
    key: str | None = None
    value_start: int | None = None
    last_string: str | None = None
    while i < n:
        ch = text[i]
        if ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                break
            if depth == 1 and value_start is None:
                last_string = text[i + 1 : j]
            i = j + 1
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if key is not None and value_start is not None:
                    keys[key] = (value_start, i)
                return keys, i + 1
        elif depth == 1 and ch == ":" and last_string is not None and value_start is None:
            key = json.loads(f'"{last_string}"')
            value_start = i + 1
            while value_start < n and text[value_start] in " \t\r\n":
                value_start += 1
            keys[key] = (value_start, None)
        elif depth == 1 and ch == ",":
            if key is not None and value_start is not None:
                keys[key] = (value_start, i)
            key, value_start, last_string = None, None, None
        i += 1
    return keys, None


def _objects(region: str) -> list[str]:
    """The call objects of a region, the last possibly unfinished: ``{...}``, a list of
    them, or several separated by ``;`` or ``,``."""
    found, i = [], 0
    while True:
        start = region.find("{", i)
        if start < 0:
            return found
        _, end = _scan_object(region[start:])
        if end is None:
            found.append(region[start:])
            return found
        found.append(region[start : start + end])
        i = start + end


class JsonToolCallParser(BaseToolParser):
    """Calls as JSON objects ``{"name": ..., "arguments" | "parameters": {...}}``, each
    region of them opened by one of ``start_markers`` and closed by ``end_marker`` (or
    the end of the answer when it is None); with ``json_at_start``, an answer whose
    first non-blank character is ``{`` or ``[`` is one region. A region that holds no
    call with a name is reported as content, markers and all."""

    start_markers: ClassVar[tuple[str, ...]] = ()
    end_marker: ClassVar[str | None] = None
    json_at_start: ClassVar[bool] = False

    def __init__(self) -> None:
        self._held = ""  # text not yet reported nor placed in a region
        self._region: str | None = None  # the open region's text, None outside one
        self._region_raw = ""  # its text with the marker, for a region that holds no call
        self._is_first_text = True  # nothing but blanks seen yet
        self._calls: list[list] = []  # per call: [id, name or None, arguments sent]
        self._region_first_call = 0

    # -- feeding ------------------------------------------------------------------
    def feed(self, text: str) -> ParserDelta:
        self._held += text
        content, pieces = [], []
        while True:
            if self._region is None:
                if self._is_first_text and self.json_at_start:
                    stripped = self._held.lstrip()
                    if not stripped:
                        break
                    self._is_first_text = False
                    if stripped[0] in "{[":
                        self._open("", stripped)
                        continue
                marker, at = self._first_marker(self._held)
                if marker is not None:
                    content.append(self._held[:at])
                    self._open(marker, self._held[at + len(marker) :])
                    continue
                keep = _partial_suffix(self._held, self.start_markers)
                content.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                if self._held.strip():
                    self._is_first_text = False
                break
            end = self._held.find(self.end_marker) if self.end_marker else -1
            if end >= 0:
                self._region += self._held[:end]
                self._region_raw += self._held[: end + len(self.end_marker)]
                self._held = self._held[end + len(self.end_marker) :]
                content.append(self._close(pieces))
                continue
            keep = _partial_suffix(self._held, (self.end_marker,)) if self.end_marker else 0
            taken = self._held[: len(self._held) - keep]
            self._region += taken
            self._region_raw += taken
            self._held = self._held[len(taken) :]
            self._report(self._region, pieces, is_final=False)
            break
        return ParserDelta("".join(content), tuple(pieces))

    def finish(self) -> ParserDelta:
        pieces: list[ToolCallDelta] = []
        if self._region is None:
            content, self._held = self._held, ""
            return ParserDelta(content, ())
        self._region += self._held
        self._region_raw += self._held
        self._held = ""
        return ParserDelta(self._close(pieces), tuple(pieces))

    def _first_marker(self, text: str) -> tuple[str | None, int]:
        best: tuple[str | None, int] = (None, len(text))
        for marker in self.start_markers:
            at = text.find(marker)
            if 0 <= at < best[1]:
                best = (marker, at)
        return best

    def _open(self, marker: str, rest: str) -> None:
        self._region, self._region_raw, self._held = "", marker, rest
        self._region_first_call = len(self._calls)
        self._is_first_text = False

    def _close(self, pieces: list[ToolCallDelta]) -> str:
        """End the open region; its text as content if it held no call."""
        self._report(self._region, pieces, is_final=True)
        raw = self._region_raw
        self._region, self._region_raw = None, ""
        return "" if len(self._calls) > self._region_first_call else raw

    def _report(self, region: str, pieces: list[ToolCallDelta], is_final: bool) -> None:
        """Append the pieces of the region's calls not reported yet."""
        for k, obj in enumerate(_objects(region)):
            index = self._region_first_call + k
            keys, end = _scan_object(obj)
            if index == len(self._calls):
                name_span = keys.get(_KEY_NAME)
                if name_span is None or name_span[1] is None:
                    return  # calls are reported in order: wait for this one's name
                try:
                    name = json.loads(obj[name_span[0] : name_span[1]])
                except json.JSONDecodeError:
                    return
                if not isinstance(name, str):
                    return
                self._calls.append([new_call_id(), name, 0])
                pieces.append(ToolCallDelta(index, self._calls[index][0], name))
            args_key = next((key for key in _ARGUMENT_KEYS if key in keys), None)
            if args_key is None:
                if end is not None or is_final:
                    self._send(index, "{}", pieces)
                continue
            start, stop = keys[args_key]
            # blanks after a value belong to no value (and may be all that came yet)
            text = (obj[start:stop] if stop is not None else obj[start:]).rstrip()
            self._send(index, text, pieces)

    def _send(self, index: int, text: str, pieces: list[ToolCallDelta]) -> None:
        sent = self._calls[index][2]
        if len(text) > sent:
            pieces.append(ToolCallDelta(index, arguments=text[sent:]))
            self._calls[index][2] = len(text)

    # -- prompts ------------------------------------------------------------------
    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = [
            json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) for c in calls
        ]
        opening = self.start_markers[0] if self.start_markers else ""
        closing = self.end_marker or ""
        return "\n".join(f"{opening}{obj}{closing}" for obj in objects)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


class ForcedToolCallParser(JsonToolCallParser):
    """The answer a forced tool choice (``required`` or a named function) is held to by
    its grammar (``ember.engine.tool_calls.forced_call_constraint``): one call object, or a
    list of them, and nothing else."""

    name = "forced"
    json_at_start = True

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return False

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """For a model without a parser of its own: the grammar writes the syntax, the
        prompt only names the functions."""
        lines = "\n".join(json.dumps(tool["function"]) for tool in tools)
        return (
            "You can call these functions, described as JSON schemas:\n"
            f"{lines}\n"
            'Call one as a JSON object {"name": <function name>, "arguments": <arguments object>}.'
        )

