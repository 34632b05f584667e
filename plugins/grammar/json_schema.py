"""Refuse, by name, the JSON-schema keywords and formats a backend cannot enforce.

Both built-in backends turn some keywords they cannot express into nothing: outlines-core
drops ``minimum``, xgrammar reads ``oneOf`` as ``anyOf``; the output would then not
validate against the schema the caller gave. Each backend lists what it enforces, and
`check_schema` walks the whole schema (``$defs`` included) and raises
`UnsupportedFeatureError` at the first keyword outside that list, with its location.

Both also enforce one keyword of a node where several compete: outlines-core keeps
``maxLength`` and drops a ``pattern`` or ``format`` beside it, or keeps an ``enum`` and
drops what else constrains the node; xgrammar does the reverse with lengths. The rules
`exclusive_keywords` and `lengths_alone` refuse those combinations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.plugin.grammar import UnsupportedFeatureError

# Keywords that describe and constrain nothing: always accepted.
ANNOTATIONS = frozenset({
    "title", "description", "$schema", "$id", "$comment", "examples", "default", "deprecated", "readOnly",
    "writeOnly",
})
# Keywords whose value is a subschema, a list of them, or a map of them.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")

# A rule beyond the keyword list: given a schema node, its location and the backend's
# name, raise for what the backend cannot express there (e.g. `multipleOf` on a number).
Rule = Callable[[dict[str, Any], str, str], None]


def exclusive_keywords(node: dict[str, Any], where: str, backend: str) -> None:
    """``enum``/``const`` (beside ``type`` only), ``$ref``, ``anyOf``, ``allOf`` stand alone
    in a node (annotations and ``$defs`` aside): the backends enforce only one of them."""
    for key in ("enum", "const", "$ref", "anyOf", "allOf"):
        if key not in node:
            continue
        allowed = ANNOTATIONS | {key, "$defs", "definitions"} | ({"type"} if key in ("enum", "const") else set())
        others = [k for k in node if k not in allowed]
        if others:
            raise UnsupportedFeatureError(backend, f"{others[0]!r} beside {key!r} in one schema (at {where})")


def lengths_alone(node: dict[str, Any], where: str, backend: str) -> None:
    """``minLength``/``maxLength`` only on a plain ``{"type": "string"}`` (no ``pattern``,
    no ``format``)."""
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if not lengths:
        return
    if node.get("type") != "string":
        raise UnsupportedFeatureError(backend, f"{lengths[0]!r} outside a {{'type': 'string'}} schema (at {where})")
    for other in ("pattern", "format"):
        if other in node:
            raise UnsupportedFeatureError(backend, f"{lengths[0]!r} together with {other!r} (at {where})")


# JSON Schema's date, time and date-time formats (RFC 3339) as patterns, for backends
# whose own format grammars are loose: outlines-core's date-time admits a year of any
# length (SmolLM2 sampled digits there until max_tokens) and its date 31 February;
# xgrammar's date-time and time any number of fraction digits. Days are those every
# year has (29 February left out), so every date admitted is real; at most 9 fraction
# digits; the time zone is required, as RFC 3339 requires it. [0-9], not \d: a
# backend's \d may be Unicode's.
_DATE = r"[0-9]{4}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}


def formats_as_patterns(node: dict[str, Any]) -> dict[str, Any]:
    """A ``{"type": "string"}`` node's ``format`` date, time or date-time (without a
    ``pattern`` of its own) as its pattern from `FORMAT_PATTERNS`; for `rewrite_schema`."""
    fmt = node.get("format")
    if node.get("type") == "string" and fmt in FORMAT_PATTERNS and "pattern" not in node:
        del node["format"]
        node["pattern"] = FORMAT_PATTERNS[fmt]
    return node


def rewrite_schema(node: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of the schema ``node`` with ``fn`` applied to every subschema, innermost first."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if key in out:
            out[key] = rewrite_schema(out[key], fn)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [rewrite_schema(sub, fn) for sub in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: rewrite_schema(sub, fn) for name, sub in out[key].items()}
    return fn(out)


def check_schema(
    schema: Any, backend: str, keywords: frozenset[str], formats: frozenset[str], rules: tuple[Rule, ...] = (),
) -> None:
    """Raise UnsupportedFeatureError for the first keyword of ``schema`` not in
    ``keywords`` (nor an annotation), the first ``format`` not in ``formats``, an
    ``allOf`` of several subschemas, or whatever a rule refuses. Locations are JSON
    pointers (``/properties/age``)."""
    _check(schema, "", backend, keywords, formats, rules)


def _check(node: Any, path: str, backend: str, keywords, formats, rules) -> None:
    if not isinstance(node, dict):
        return  # `true` / `false` subschemas
    where = path or "/"
    for key, value in node.items():
        if key in ANNOTATIONS:
            continue
        if key not in keywords:
            raise UnsupportedFeatureError(backend, f"JSON schema keyword {key!r} (at {where})")
        if key == "format" and value not in formats:
            raise UnsupportedFeatureError(
                backend, f"string format {value!r} (at {where})", f"; it supports {', '.join(sorted(formats))}"
            )
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise UnsupportedFeatureError(backend, f"'allOf' with {len(value)} subschemas (at {where})")
    for rule in rules:
        rule(node, where, backend)
    for key in _ONE:
        if key in node:
            _check(node[key], f"{path}/{key}", backend, keywords, formats, rules)
    for key in _LIST:
        for i, sub in enumerate(node.get(key) or ()):
            _check(sub, f"{path}/{key}/{i}", backend, keywords, formats, rules)
    for key in _MAP:
        for name, sub in (node.get(key) or {}).items():
            name = str(name).replace("~", "~0").replace("/", "~1")  # a JSON pointer's escapes
            _check(sub, f"{path}/{key}/{name}", backend, keywords, formats, rules)
