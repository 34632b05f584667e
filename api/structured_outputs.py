"""A request's structured-output fields as one `ember.constraint.Constraint`, and the 400
that a failed grammar becomes.

OpenAI routes take `response_format` (``json_object``, ``json_schema``), vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with
``guided_decoding_backend``) and their newer ``structured_outputs`` object; TGI takes
``parameters.grammar`` (``{"type": "json" | "regex", "value": ...}``). At most one
constraint per request. What can be checked before the engine is checked here (the
value's shape, the backend's name, the kinds it compiles); what only compiling finds
(an invalid schema or regex, a feature the backend refuses, a compile past the
timeout) comes back as the request's first output, with finish reason ``error``, and
`failure` turns it into a 400 before any header is sent (streams wait for that
output too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ember.api.errors import APIError, bad_request
from ember.constraint import Constraint
from ember.engine.client import EngineClient
from ember.outputs import RequestOutput
from ember.plugin.reasoning_parser import BaseReasoningParser
from ember.sampling_params import SamplingParams

GRAMMAR_ERROR_TYPE = "grammar"


def after_reasoning(params: SamplingParams, parser: type[BaseReasoningParser] | None) -> SamplingParams:
    """``params`` whose constraint applies after the reasoning ``parser`` (--reasoning-parser)
    reads, not inside it (docs/grammar.md, "Grammars after reasoning")."""
    span = parser.grammar_span() if parser is not None and params.constraint is not None else None
    return params if span is None else dataclasses.replace(params, grammar_after=span)


def _constraint(param: str, make) -> Constraint:
    try:
        return make()
    except ValueError as exc:
        raise bad_request(f"`{param}`: {exc}", param) from None


def _grammar(text: str) -> Constraint:
    """GBNF (rules written ``::=``, as vLLM's guided_grammar and llama.cpp) or Lark."""
    return Constraint.ebnf(text) if "::=" in text else Constraint.lark(text)


def openai_constraint(body: Any) -> tuple[Constraint | None, str | None]:
    """The constraint of an OpenAI request and the field it came from; 400 for two of
    them, or a value that is not one."""
    found: list[tuple[str, Any]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint.json_object))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request('`response_format` of type "json_schema" needs `json_schema.schema`', "response_format")
        found.append(("response_format", lambda: Constraint.json_schema(rf.json_schema.schema_)))
    fields = [
        ("guided_json", body.guided_json, Constraint.json_schema),
        ("guided_regex", body.guided_regex, Constraint.regex),
        ("guided_choice", body.guided_choice, lambda value: Constraint.choice(tuple(value))),
        ("guided_grammar", body.guided_grammar, _grammar),
    ]
    so = body.structured_outputs
    if so is not None:
        fields += [
            ("structured_outputs.json", so.json_, Constraint.json_schema),
            ("structured_outputs.regex", so.regex, Constraint.regex),
            ("structured_outputs.choice", so.choice, lambda value: Constraint.choice(tuple(value))),
            ("structured_outputs.grammar", so.grammar, _grammar),
            ("structured_outputs.json_object", so.json_object or None, lambda _: Constraint.json_object()),
        ]
    for param, value, factory in fields:
        if value is not None:
            found.append((param, lambda factory=factory, value=value: factory(value)))
    if len(found) > 1:
        names = ", ".join(f"`{param}`" for param, _ in found)
        raise bad_request(f"give one structured-output constraint per request, got {names}", found[1][0])
    if not found:
        return None, None
    param, make = found[0]
    return _constraint(param, make), param


def tgi_constraint(grammar: Any) -> Constraint | None:
    """TGI's ``parameters.grammar``: ``{"type": "json", "value": schema (object or
    text)}`` or ``{"type": "regex", "value": pattern}``."""
    if grammar is None:
        return None
    kind = grammar.get("type") if isinstance(grammar, dict) else None
    if kind not in ("json", "regex") or "value" not in grammar:
        raise bad_request(
            f'`parameters.grammar` must be {{"type": "json" | "regex", "value": ...}}, got {grammar!r}'[:300],
            "grammar",
        )
    value = grammar["value"]
    make = (lambda: Constraint.json_schema(value)) if kind == "json" else (lambda: Constraint.regex(value))
    return _constraint("parameters.grammar", make)


def check_backend(client: EngineClient, constraint: Constraint | None, backend: str | None, param: str) -> None:
    """400 for a backend that is not registered, or one that does not compile this kind
    of constraint (a request that names none may be moved to one that does)."""
    if backend is None:
        return
    registry = client.plugin_manager.registries.grammar_backends
    if backend not in registry:
        known = ", ".join(registry.names()) or "none"
        raise bad_request(f"unknown grammar backend {backend!r}; registered: {known}", param)
    if constraint is not None:
        try:
            registry.get(backend).check_kind(constraint)
        except ValueError as exc:
            raise bad_request(str(exc), param) from None


def failure(out: RequestOutput, param: str | None) -> APIError | None:
    """The 400 for an output that ended in error (its grammar failed), else None."""
    completion = next((c for c in out.outputs if c.finish_reason == "error"), None)
    if completion is None:
        return None
    return APIError(400, completion.error or "the request's grammar failed", GRAMMAR_ERROR_TYPE, param)
