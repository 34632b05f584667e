"""``<think>...</think>`` reasoning, the syntax of DeepSeek-R1 and Qwen3.

* ``deepseek_r1``: the answer may start inside the reasoning (R1's template opens
  ``<think>`` in the prompt): everything before ``</think>`` is reasoning, a leading
  ``<think>`` is dropped; an answer without ``</think>`` is all reasoning (it was cut).
* ``qwen3``: reasoning only when the answer opens with ``<think>`` (Qwen3 with thinking
  on); otherwise the whole answer is content (thinking off, ``/no_think``).
"""

from __future__ import annotations

from ember.plugin import Registry, hookimpl
from ember.plugin.reasoning_parser import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "<｜Assistant｜>" in chat_template and "</think>" in chat_template


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "<|im_start|>" in chat_template and "<think>" in chat_template


@hookimpl
def ember_register_reasoning_parsers(registry: Registry) -> None:
    registry.register(DeepSeekR1ReasoningParser.name, DeepSeekR1ReasoningParser)
    registry.register(Qwen3ReasoningParser.name, Qwen3ReasoningParser)
