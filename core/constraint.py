"""What a request's output must match (grammar-guided decoding, docs/grammar.md): a
plain, hashable, picklable value carried by `SamplingParams.constraint` and compiled by
a grammar backend (`ember.plugin.grammar`)."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # value: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object); no value
    REGEX = "regex"  # value: the pattern, matched in full
    CHOICE = "choice"  # value: a tuple of the allowed strings, one of which is the whole output
    EBNF = "ebnf"  # value: a GBNF grammar (llama.cpp's EBNF) whose start rule is `root`
    LARK = "lark"  # value: a Lark grammar whose start rule is `start`


def _check_text(kind: ConstraintKind, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind.value} constraint needs a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match: plain, hashable, picklable data.

    Build one with the factories (``Constraint.json_schema({...})``,
    ``Constraint.regex(r"\\d+")``, ``Constraint.choice(["yes", "no"])``,
    ``Constraint.json_object()``, ``Constraint.ebnf(...)``, ``Constraint.lark(...)``);
    they check the value and raise ValueError naming it. A schema is kept as compact
    JSON text in the caller's key order (the order properties are generated in), so
    equal schemas written alike share a compiled grammar.
    """

    kind: ConstraintKind
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise ValueError(f"constraint kind must be a ConstraintKind, got {self.kind!r}")
        if self.kind is ConstraintKind.JSON_OBJECT:
            if self.value:
                raise ValueError(f"a json_object constraint takes no value, got {self.value!r}")
        elif self.kind is ConstraintKind.CHOICE:
            options = self.value
            if not isinstance(options, tuple) or not options or not all(isinstance(o, str) and o for o in options):
                raise ValueError(f"a choice constraint needs a non-empty tuple of non-empty strings, got {options!r}")
        else:
            _check_text(self.kind, self.value)
        if self.kind is ConstraintKind.JSON_SCHEMA:
            schema = json.loads(self.value)
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {self.value!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        """A JSON schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"JSON schema is not valid JSON ({exc}): {schema[:200]!r}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {schema!r}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"JSON schema cannot be written as JSON: {exc}") from None
        return cls(ConstraintKind.JSON_SCHEMA, text)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, _check_text(ConstraintKind.REGEX, pattern))

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise ValueError(f"a choice constraint needs a list of strings, got {options!r}")
        return cls(ConstraintKind.CHOICE, tuple(options))

    @classmethod
    def ebnf(cls, grammar: str) -> Constraint:
        return cls(ConstraintKind.EBNF, _check_text(ConstraintKind.EBNF, grammar))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        return cls(ConstraintKind.LARK, _check_text(ConstraintKind.LARK, grammar))

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of a json_schema constraint; ``{"type": "object"}`` for json_object."""
        if self.kind is ConstraintKind.JSON_OBJECT:
            return {"type": "object"}
        if self.kind is not ConstraintKind.JSON_SCHEMA:
            raise ValueError(f"a {self.kind.value} constraint has no JSON schema")
        return json.loads(self.value)

    def describe(self, limit: int = 80) -> str:
        """A short description for messages and logs."""
        value = self.value if isinstance(self.value, str) else "|".join(self.value)
        return f"{self.kind.value} {value[:limit]!r}" + ("..." if len(value) > limit else "")


_REGEX_SPECIALS = frozenset("\\.^$|?*+()[]{}")


def choice_regex(options: Sequence[str]) -> str:
    """A regex matching exactly one of ``options``: only regex metacharacters are
    escaped (Python's ``re.escape`` also escapes spaces and ``-``, which not every
    backend's regex dialect accepts). Longest first: under leftmost-first alternation
    (outlines-core's DFA) an option that is a prefix of a later one would hide it."""
    ordered = sorted(options, key=len, reverse=True)
    return "|".join("".join("\\" + ch if ch in _REGEX_SPECIALS else ch for ch in option) for option in ordered)
