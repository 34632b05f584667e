"""Conformance check for a reasoning parser (the contract: `ember.plugin.reasoning_parser`).

    from ember.testing import check_reasoning_parser
    check_reasoning_parser(MyParser)   # AssertionError naming the first broken rule

Answers are written with the parser's own tags (reasoning then answer, the answer
alone, a reasoning cut before its end tag, tags and look-alikes such as ``<thin`` and
``</b>`` in the text), read whole with `extract`, then fed in pieces of every size from
1 to 7 characters and in random pieces: the reasoning and the content must be the same
whatever the split, and nothing may be lost or repeated (the two together are the text
less the tags). An answer without tags is passed through whole: as content, or (for a
syntax whose answers start inside the reasoning) as reasoning. `grammar_span` (optional)
is None or a `ReasoningSpan` that agrees with the parser: a text it spans as reasoning
then answer is read so.
"""

from __future__ import annotations

import random

from ember.plugin.reasoning_parser import BaseReasoningParser, ReasoningDelta
from ember.sampling_params import ReasoningSpan

REASONING = ["Let me think. 2 + 2 = 4, <b>bold</b> and a < sign", "", "\n", "line one\nline two </thin"]
ANSWERS = ["The answer is 4.", "", " <thi not a tag", "\n\nDone </b>"]
PLAIN = ["Hello there.", "It is 12:00 <b>now</b>.", "<", "<th", "a </think-like> text"]


def _fed(parser_cls: type[BaseReasoningParser], pieces: list[str]) -> tuple[str | None, str]:
    parser = parser_cls()
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        assert isinstance(delta, ReasoningDelta), f"{parser_cls.name}: feed and finish return a ReasoningDelta"
    reasoning = "".join(d.reasoning for d in deltas)
    return (reasoning if reasoning or parser.saw_reasoning else None), "".join(d.content for d in deltas)


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    splits = [[text[i : i + size] for i in range(0, len(text), size)] for size in range(1, 8)]
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


def _check_splits(parser_cls: type[BaseReasoningParser], text: str, rng: random.Random) -> tuple[str | None, str]:
    whole = parser_cls().extract(text)
    assert isinstance(whole, tuple) and len(whole) == 2, f"{parser_cls.name}: extract returns (reasoning, content)"
    for pieces in _splits(text, rng):
        got = _fed(parser_cls, pieces)
        assert got == whole, f"{parser_cls.name}: {text!r} fed as {pieces} reads {got}, whole it reads {whole}"
    return whole


def _check_span(parser_cls: type[BaseReasoningParser]) -> None:
    """The span a grammar waits for: the reasoning before its end tag, the answer after."""
    span = parser_cls.grammar_span()
    if span is None:
        return
    assert isinstance(span, ReasoningSpan), f"{parser_cls.name}: grammar_span returns None or a ReasoningSpan"
    opening = "" if span.starts_inside else span.start_tag
    text = f"{opening}thinking{span.end_tag}{{\"answer\": 1}}"
    reasoning, content = parser_cls().extract(text)
    assert (reasoning, content) == ("thinking", '{"answer": 1}'), (
        f"{parser_cls.name}: its grammar_span {span} says {text!r} is reasoning then an answer; "
        f"the parser reads reasoning {reasoning!r}, content {content!r}"
    )
    if not span.starts_inside:
        assert parser_cls().extract('{"answer": 1}') == (None, '{"answer": 1}'), (
            f"{parser_cls.name}: its grammar_span says an answer without {span.start_tag!r} has no reasoning"
        )


def check_reasoning_parser(parser_cls: type[BaseReasoningParser], seed: int = 0) -> None:
    assert isinstance(parser_cls.name, str) and parser_cls.name, "a parser needs a non-empty `name`"
    start, end = parser_cls.start_tag, parser_cls.end_tag
    assert start and end, f"{parser_cls.name}: start_tag and end_tag must be non-empty"
    assert isinstance(parser_cls.matches_template(""), bool), f"{parser_cls.name}: matches_template returns a bool"
    _check_span(parser_cls)
    rng = random.Random(seed)
    for thought in REASONING:
        for answer in ANSWERS:
            text = f"{start}{thought}{end}{answer}"
            reasoning, content = _check_splits(parser_cls, text, rng)
            assert (reasoning, content) == (thought, answer), (
                f"{parser_cls.name}: {text!r} read as reasoning {reasoning!r}, content {content!r}"
            )
        cut = f"{start}{thought}"
        reasoning, content = _check_splits(parser_cls, cut, rng)
        assert (reasoning, content) == (thought, ""), (
            f"{parser_cls.name}: a reasoning cut before {end!r}, {cut!r}, read as {reasoning!r}, {content!r}"
        )
    for text in PLAIN:
        reasoning, content = _check_splits(parser_cls, text, rng)
        assert (reasoning, content) in ((None, text), (text, "")), (
            f"{parser_cls.name}: {text!r} without tags must come back whole, got reasoning {reasoning!r}, "
            f"content {content!r}"
        )
