"""Conformance check for a tool-call parser (the contract: `ember.plugin.tool_parser`).

    from ember.testing import check_tool_parser
    check_tool_parser(MyParser)   # AssertionError naming the first broken rule

Calls are written with the parser's own `format_tool_calls` (so any syntax is
covered), then read back whole and fed in pieces of every size from 1 to 7 characters:
the calls (names, arguments as JSON values) must come back, the same whatever the split,
each call's first piece with its id and name, arguments pieces concatenating to its
arguments; text without calls is content, unchanged, whatever the split. Text before
the calls is content (or, for a syntax where calls open the answer, the whole text is):
nothing is lost.
"""

from __future__ import annotations

import json

from ember.plugin.tool_parser import BaseToolParser, ParsedMessage, assemble

CALLS = [
    [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}],
    [{"function": {"name": "lookup", "arguments": {"q": "a \"quoted\" {brace} [x]", "n": [1, {"k": None}]}}},
     {"function": {"name": "noop", "arguments": {}}}],
    [{"function": {"name": "nested", "arguments": {"name": "not the call's name", "arguments": {"deep": True}}}}],
]
PLAIN = ["Hello there.", "A brace { and a bracket [ in prose", "It is 12:00 <b>now</b>."]
PREFIX = "Let me check that. "


def _fed(parser_cls: type[BaseToolParser], text: str, size: int) -> ParsedMessage:
    parser = parser_cls()
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    deltas.append(parser.finish())
    seen: set[int] = set()
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in seen:
                assert piece.id and piece.name, f"{parser_cls.name}: call {piece.index}'s first piece lacks id or name"
                assert piece.index == len(seen), f"{parser_cls.name}: calls must be numbered 0, 1, ... in order"
                seen.add(piece.index)
            else:
                assert piece.id is None and piece.name is None, f"{parser_cls.name}: id and name come once per call"
    return assemble(deltas)


def _summary(message: ParsedMessage) -> tuple:
    return ((message.content or "").strip(), [(c.name, json.loads(c.arguments)) for c in message.tool_calls])


def check_tool_parser(parser_cls: type[BaseToolParser]) -> None:
    assert isinstance(parser_cls.name, str) and parser_cls.name, "a parser needs a non-empty `name`"
    writer = parser_cls()
    assert writer.tool_prompt([{"type": "function", "function": {"name": "f", "parameters": {}}}]), \
        f"{parser_cls.name}: tool_prompt must describe the tools"
    for calls in CALLS:
        text = writer.format_tool_calls(calls)
        expected = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        whole = parser_cls().parse(text)
        got = _summary(whole)[1]
        assert got == expected, f"{parser_cls.name}: {text!r} read as {got}, expected {expected}"
        assert all(c.id for c in whole.tool_calls), f"{parser_cls.name}: every call needs an id"
        for size in range(1, 8):
            fed = _fed(parser_cls, text, size)
            assert _summary(fed) == _summary(whole), f"{parser_cls.name}: fed in pieces of {size}, {text!r} reads differently"
        after = PREFIX + text
        for size in (1, 5, len(after)):
            fed = _fed(parser_cls, after, size)
            if fed.tool_calls:
                assert _summary(fed) == (PREFIX.strip(), expected), f"{parser_cls.name}: {after!r} read as {fed}"
            else:
                assert fed.content == after, f"{parser_cls.name}: {after!r} lost text: {fed}"
    for text in PLAIN:
        for size in (1, 3, len(text)):
            fed = _fed(parser_cls, text, size)
            assert fed.content == text and not fed.tool_calls, (
                f"{parser_cls.name}: plain text {text!r} fed in pieces of {size} came back as {fed}"
            )
