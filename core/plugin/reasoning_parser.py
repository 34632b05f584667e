"""The reasoning parser contract: a reasoning model's thinking kept out of its answer.

Reasoning models (DeepSeek-R1, Qwen3, QwQ) write their thinking between tags before
the answer: ``<think>...</think>answer``. A parser is a :class:`BaseReasoningParser`
subclass registered by class through the ``ember_register_reasoning_parsers`` hook;
``ember serve --reasoning-parser NAME`` picks one, and /v1/chat/completions then
returns the thinking as ``reasoning_content`` beside ``content`` (docs/reasoning.md).

One parser instance follows one generated answer: `feed` takes each new piece of text
and returns what can be reported now as a :class:`ReasoningDelta` (reasoning, content),
`finish` flushes what was held back. Invariants every parser keeps, whatever the split
into pieces (``ember.testing.check_reasoning_parser`` checks them):

* the reasoning and the content reported over the whole answer are those of the whole
  text fed at once (`extract`);
* nothing is lost or repeated: the reasoning and the content are the text less the tags;
* text that may still turn out to be a tag is held back, never reported half.

:class:`ThinkTagReasoningParser` implements this for a start and an end tag; both
built-in parsers are it with their tags and their answer to "what if the text does not
open with the start tag".

A grammar (a ``response_format`` schema, a forced tool call) constrains the answer, not
the reasoning: `grammar_span` (optional, plugin API 1.4) tells the engine where the
reasoning ends, and the engine leaves the output free until then (docs/grammar.md).
"""

from __future__ import annotations

import abc
from typing import ClassVar, NamedTuple

from ember.sampling_params import ReasoningSpan


class ReasoningDelta(NamedTuple):
    reasoning: str = ""
    content: str = ""


class BaseReasoningParser(abc.ABC):
    name: ClassVar[str]
    #: the tags around the reasoning (the conformance check writes texts with them)
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        """Whether a model with this chat template writes this syntax (optional: used to
        warn when the chosen parser does not fit the model)."""
        return False

    @classmethod
    def grammar_span(cls) -> ReasoningSpan | None:
        """Where the reasoning sits, so that a constraint applies only to the answer after
        it (the engine follows the generated tokens: free until the end tag, the grammar
        from the next token). None (the default): the answer is constrained from its
        first token, reasoning included, as before plugin API 1.4."""
        return None

    @abc.abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """The next piece of generated text; the reasoning and content to report now."""

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta:
        """The answer ended: everything still held."""

    @property
    def saw_reasoning(self) -> bool:
        """Whether the answer so far had a reasoning section (``reasoning_content`` is
        null otherwise)."""
        return False

    def extract(self, text: str) -> tuple[str | None, str]:
        """A whole answer at once (on a fresh parser): (reasoning or None, content)."""
        first, last = self.feed(text), self.finish()
        reasoning = first.reasoning + last.reasoning
        return (reasoning if reasoning or self.saw_reasoning else None), first.content + last.content


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkTagReasoningParser(BaseReasoningParser):
    """Reasoning between `start_tag` and `end_tag` at the start of the answer. When the
    answer does not open with `start_tag`, it is content (``starts_in_reasoning`` False)
    or reasoning until `end_tag` (True: templates that put the start tag in the prompt)."""

    starts_in_reasoning: ClassVar[bool] = False

    @classmethod
    def grammar_span(cls) -> ReasoningSpan:
        return ReasoningSpan(cls.start_tag, cls.end_tag, cls.starts_in_reasoning)

    def __init__(self) -> None:
        self._mode = "start"  # "start" (the opening not yet known), "reasoning", "content"
        self._held = ""
        self._reasoned = False

    @property
    def saw_reasoning(self) -> bool:
        return self._reasoned

    def feed(self, text: str) -> ReasoningDelta:
        buf = self._held + text
        reasoning, content = [], []
        while buf:
            if self._mode == "start":
                if buf.startswith(self.start_tag):
                    buf, self._mode, self._reasoned = buf[len(self.start_tag):], "reasoning", True
                    continue
                if self.start_tag.startswith(buf):
                    break  # may still become the start tag
                self._mode = "reasoning" if self.starts_in_reasoning else "content"
                self._reasoned = self.starts_in_reasoning
            elif self._mode == "reasoning":
                end = buf.find(self.end_tag)
                if end >= 0:
                    reasoning.append(buf[:end])
                    buf, self._mode = buf[end + len(self.end_tag):], "content"
                    continue
                keep = _held(buf, self.end_tag)
                reasoning.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            else:
                content.append(buf)
                buf = ""
        self._held = buf
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if self._mode == "reasoning":
            return ReasoningDelta(held, "")
        if self._mode == "start" and held and self.starts_in_reasoning:
            self._reasoned = True
            return ReasoningDelta(held, "")
        return ReasoningDelta("", held)
