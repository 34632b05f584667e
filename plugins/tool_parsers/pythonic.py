"""Pythonic tool calls (Llama 3.2's and Llama 4's "pythonic" format): the answer opens with
a Python list of calls, ``[get_weather(city="Paris", unit="c"), other(x=1)]``, read with
:mod:`ast`. A call is a plain function name with keyword arguments only, each value a
literal (a string, a finite number, True/False/None, or lists and dicts of them, dict keys
strings); the arguments become a JSON object. Text after the list is content; an answer
that opens with anything else, or whose list holds anything else, is all content (no code
is ever run).

The list is held back until its closing ``]``; then all its calls are reported at once.
Read for templates that teach the syntax (``[func_name1(params_name1=params_value1, ...``)
and for Llama 4's (``<|header_start|>``).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from ember.plugin import Registry, hookimpl
from ember.plugin.tool_parser import BaseToolParser, ParserDelta, ToolCallDelta, new_call_id


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.AST) -> Any:
    """A JSON value from a literal node; anything else raises _NotLiteral."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)) and math.isfinite(value):
            return value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        result = {}
        for key, value in zip(node.keys, node.values):
            if key is None:  # a ``**spread``
                raise _NotLiteral
            name = _literal(key)
            if not isinstance(name, str):
                raise _NotLiteral
            result[name] = _literal(value)
        return result
    raise _NotLiteral


def parse_call_list(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of ``text`` if it is exactly a non-empty list of pythonic calls, else None."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:
                return None
            try:
                arguments[keyword.arg] = _literal(keyword.value)
            except (_NotLiteral, RecursionError):
                return None
        calls.append((node.func.id, arguments))
    return calls


def _is_list_end(text: str) -> bool:
    """Whether ``text`` (which opens with ``[``) is a whole Python expression."""
    try:
        ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return False
    return True


class PythonicToolParser(BaseToolParser):
    name = "pythonic"

    def __init__(self) -> None:
        self._held = ""  # the answer so far, while it may still open with a call list
        self._scanned = 0  # how much of _held was searched for the list's end
        self._passing = False  # decided: the rest is content

    @classmethod
    def matches_template(cls, chat_template: str) -> bool:
        return "[func_name1(" in chat_template or "<|header_start|>" in chat_template

    def feed(self, text: str) -> ParserDelta:
        if self._passing:
            return ParserDelta(text)
        self._held += text
        stripped = self._held.lstrip()
        if not stripped:
            return ParserDelta()
        if stripped[0] != "[":
            return self._pass()
        while True:
            end = self._held.find("]", self._scanned)
            if end < 0:
                self._scanned = len(self._held)
                return ParserDelta()
            self._scanned = end + 1
            if _is_list_end(self._held[: end + 1]):
                break
        calls = parse_call_list(self._held[: end + 1])
        if calls is None:
            return self._pass()
        rest, self._held, self._passing = self._held[end + 1 :], "", True
        pieces = tuple(
            ToolCallDelta(index, new_call_id(), name, json.dumps(arguments))
            for index, (name, arguments) in enumerate(calls)
        )
        return ParserDelta(rest, pieces)

    def _pass(self) -> ParserDelta:
        content, self._held, self._passing = self._held, "", True
        return ParserDelta(content)

    def finish(self) -> ParserDelta:
        content, self._held = self._held, ""
        return ParserDelta(content)

    def tool_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Llama 3.2's prompt for pythonic calls."""
        signatures = "\n".join(json.dumps(tool) for tool in tools)
        return (
            "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
            "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
            "If you decide to invoke any of the function(s), you MUST put it in the format of "
            "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
            "You SHOULD NOT include any other text in the response if you call a function.\n"
            f"Here is a list of functions in JSON format that you can invoke.\n{signatures}"
        )

    def format_tool_calls(self, calls: list[dict[str, Any]]) -> str:
        written = []
        for call in calls:
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            keywords = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
            written.append(f"{call['function']['name']}({keywords})")
        return f"[{', '.join(written)}]"


@hookimpl
def ember_register_tool_parsers(registry: Registry) -> None:
    registry.register(PythonicToolParser.name, PythonicToolParser)
