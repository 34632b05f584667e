"""Size limits on a request's constraint, checked before anything compiles it.

A grammar's compile time grows with its schema: a 30,000-value enum kept outlines-core
busy for a minute. The limits refuse such a constraint at once, in the API process,
with a message naming the limit and the flag that raises it
(``--grammar-limits enum_values=5000``, or ``EMBER_GRAMMAR_LIMITS``). Walking a schema
costs microseconds per node; nothing here depends on a grammar backend.

What is counted (`GrammarLimits`): properties in one object, values of one ``enum``
(and the options of a choice constraint), nesting depth of subschemas, characters of
one ``pattern`` (and of a regex constraint), and the constraint's whole text (the
schema's compact JSON, a regex, the options, an EBNF or Lark grammar) in UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ember.constraint import Constraint, ConstraintKind

FLAG = "--grammar-limits"
ENV = "EMBER_GRAMMAR_LIMITS"
# keywords whose value is one subschema, a list of them, or a map of them (as ember.plugins.grammar.json_schema)
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


@dataclass(frozen=True)
class GrammarLimits:
    """The largest constraint the server compiles; each > 0."""

    properties: int = 256  # properties of one object
    enum_values: int = 1024  # values of one enum, options of a choice constraint
    depth: int = 32  # subschemas nested in one another
    pattern_length: int = 2048  # characters of one pattern or of a regex constraint
    schema_bytes: int = 262_144  # the whole constraint's text, UTF-8

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{FLAG} {field.name} must be an integer > 0, got {value!r}")

    @classmethod
    def parse(cls, text: str | None) -> GrammarLimits:
        """``"enum_values=5000,depth=64"`` (comma- or space-separated ``KEY=VALUE``); the
        keys left out keep their defaults. ValueError naming a bad key or value."""
        if not text or not text.strip():
            return cls()
        known = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, int] = {}
        for item in text.replace(",", " ").split():
            key, sep, value = item.partition("=")
            if not sep or key not in known:
                raise ValueError(f"{FLAG}: {item!r} is not KEY=VALUE with KEY one of {', '.join(known)}")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"{FLAG} {key} must be an integer > 0, got {value!r}") from None
        return cls(**values)

    def format(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


class GrammarLimitError(ValueError):
    """A constraint over one of the limits; the message names it and how to raise it."""

    def __init__(self, limit: str, found: int, allowed: int, where: str = "") -> None:
        self.limit = limit
        at = f" at {where}" if where else ""
        super().__init__(
            f"the constraint is too large to compile: {found} {_WHAT[limit]}{at}, over the limit of {allowed} "
            f"(raise it with {FLAG} {limit}=N or {ENV})"
        )


_WHAT = {
    "properties": "properties in one object",
    "enum_values": "values in one enum",
    "depth": "levels of nested schemas",
    "pattern_length": "characters in one pattern",
    "schema_bytes": "bytes of constraint text",
}


def check_constraint(constraint: Constraint, limits: GrammarLimits) -> None:
    """Raise `GrammarLimitError` for the first limit ``constraint`` exceeds."""
    kind, value = constraint.kind, constraint.value
    size = sum(len(v.encode()) for v in value) if isinstance(value, tuple) else len(value.encode())
    if size > limits.schema_bytes:
        raise GrammarLimitError("schema_bytes", size, limits.schema_bytes)
    if kind is ConstraintKind.CHOICE and len(value) > limits.enum_values:
        raise GrammarLimitError("enum_values", len(value), limits.enum_values)
    if kind is ConstraintKind.REGEX and len(value) > limits.pattern_length:
        raise GrammarLimitError("pattern_length", len(value), limits.pattern_length)
    if kind is ConstraintKind.JSON_SCHEMA:
        _check_node(json.loads(value), "", 1, limits)


def _check_node(node: Any, path: str, depth: int, limits: GrammarLimits) -> None:
    if not isinstance(node, dict):
        return
    where = path or "/"
    if depth > limits.depth:
        raise GrammarLimitError("depth", depth, limits.depth, where)
    for key, limit in (("properties", "properties"), ("enum", "enum_values")):
        items = node.get(key)
        if isinstance(items, (dict, list)) and len(items) > getattr(limits, limit):
            raise GrammarLimitError(limit, len(items), getattr(limits, limit), f"{path}/{key}")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and len(pattern) > limits.pattern_length:
        raise GrammarLimitError("pattern_length", len(pattern), limits.pattern_length, f"{path}/pattern")
    for key in _ONE:
        if key in node:
            _check_node(node[key], f"{path}/{key}", depth + 1, limits)
    for key in _LIST:
        subs = node.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                _check_node(sub, f"{path}/{key}/{i}", depth + 1, limits)
    for key in _MAP:
        subs = node.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                _check_node(sub, f"{path}/{key}/{str(name).replace('~', '~0').replace('/', '~1')}", depth + 1, limits)
