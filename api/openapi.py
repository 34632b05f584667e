"""The OpenAPI document, built from the pydantic schemas each route declares with
`@documented`, and a self-contained /docs page that renders it. A route without
`@documented` (a third party's plugin route) is listed too, with its docstring's
first line as summary, so the document names every route the server answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route


@dataclass(frozen=True)
class RouteDoc:
    summary: str
    tag: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    response_is_list: bool = False
    streams: bool = False  # answers text/event-stream (always, or when the body asks)
    text_media_type: str | None = None  # answers plain text of this media type (e.g. /metrics)
    errors: tuple[int, ...] = (400, 408, 413, 415, 422, 429)
    error_model: type[BaseModel] | None = None


GENERATION_ERRORS = (400, 404, 408, 413, 415, 422, 429)  # routes that select a model or LoRA adapter


def documented(**kwargs: Any) -> Callable:
    """Attach a RouteDoc to a handler: ``@documented(summary=..., tag=..., request=M)``."""

    def mark(fn: Callable) -> Callable:
        fn.__openapi__ = RouteDoc(**kwargs)
        return fn

    return mark


# Each server-sent event (OpenAPI 3.2's `itemSchema` of a sequential media type): its
# `data` line is the JSON of one chunk, `event` names it where the API does (Anthropic, Responses).
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                              "id": {"type": "string"}, "retry": {"type": "integer"}},
             "required": ["data"]}


def _route_docs(routes: list[Route]) -> list[tuple[Route, RouteDoc]]:
    return [(route, getattr(route.endpoint, "__openapi__", None) or _undocumented(route)) for route in routes]


def _components(docs: list[tuple[Route, RouteDoc]]) -> tuple[dict, dict]:
    """Every model's JSON schema in one namespace: pydantic names each once and qualifies
    names that two models share (the OpenAI, Anthropic and TGI ``Usage``, ``ErrorResponse``,
    ...), so no route's reference lands on another API's model. (refs by (model, mode),
    the components)."""
    from pydantic.json_schema import models_json_schema

    wanted: dict[tuple[type[BaseModel], str], None] = {}
    for _, doc in docs:
        if doc.request is not None:
            wanted[(doc.request, "validation")] = None
        for model in (doc.response, doc.error_model):
            if model is not None:
                wanted[(model, "serialization")] = None
    if not wanted:
        return {}, {}
    refs, schema = models_json_schema(list(wanted), ref_template="#/components/schemas/{model}")
    names = {name: _readable(name) for name in schema.get("$defs", {})}
    text = json.dumps([{f"{model.__module__}.{model.__qualname__}|{mode}": ref for (model, mode), ref in refs.items()},
                       schema.get("$defs", {})])
    for name, readable in names.items():
        text = text.replace(f'"#/components/schemas/{name}"', f'"#/components/schemas/{readable}"')
    by_key, defs = json.loads(text)
    refs = {key: by_key[f"{key[0].__module__}.{key[0].__qualname__}|{key[1]}"] for key in refs}
    return refs, {names[name]: definition for name, definition in defs.items()}


def _readable(name: str) -> str:
    """pydantic's name for a model whose name another shares, ``ember__api__schemas__anthropic__Usage``,
    as the API's prefix and the name: ``AnthropicUsage``; other names stay."""
    if "__" not in name:
        return name
    *module, model = name.split("__")
    api = module[-1] if module else ""
    return API_PREFIXES.get(api, api.title().replace("_", "")) + model


API_PREFIXES = {"openai": "OpenAI", "anthropic": "Anthropic", "tgi": "TGI"}


def build_openapi(routes: list[Route], version: str) -> dict:
    docs = _route_docs(routes)
    refs, components = _components(docs)
    paths: dict[str, Any] = {}
    for route, doc in docs:
        for method in sorted(m for m in (route.methods or ()) if m != "HEAD"):
            op: dict[str, Any] = {"summary": doc.summary, "tags": [doc.tag], "responses": {}}
            if doc.request is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(doc.request, "validation")]}},
                }
            ok: dict[str, Any] = {"description": "success"}
            content: dict[str, Any] = {}
            if doc.response is not None:
                ref = refs[(doc.response, "serialization")]
                content["application/json"] = {"schema": {"type": "array", "items": ref} if doc.response_is_list else ref}
            if doc.streams:
                content["text/event-stream"] = {"schema": {"type": "string", "description": "server-sent events"},
                                                "itemSchema": SSE_EVENT}
            if doc.text_media_type is not None:
                content[doc.text_media_type] = {"schema": {"type": "string"}}
            if content:
                ok["content"] = content
            op["responses"]["200"] = ok
            if doc.request is not None or "{" in route.path:  # a body to refuse, or a path naming what may not exist
                statuses = sorted({*doc.errors, *((404,) if "{" in route.path else ())})
                for status in statuses:
                    error = {"description": _ERROR_TEXT.get(status, "error")}
                    if doc.error_model is not None:
                        error["content"] = {"application/json": {"schema": refs[(doc.error_model, "serialization")]}}
                    op["responses"][str(status)] = error
            paths.setdefault(route.path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Ember", "version": version, "description": "TGI- and OpenAI-compatible LLM inference server"},
        "paths": paths,
        "components": {"schemas": components},
    }


def _undocumented(route: Route) -> RouteDoc:
    lines = (getattr(route.endpoint, "__doc__", None) or "").strip().splitlines()
    return RouteDoc(summary=lines[0] if lines else route.path, tag="Plugins")


_ERROR_TEXT = {
    400: "malformed JSON (or not strict JSON: NaN, infinite numbers, too deep) or body not UTF-8",
    401: "missing or wrong API key (with --api-key)",
    404: "a model or LoRA adapter name that is not served (the message lists those that are), a route that is off, "
         "or (a path with a parameter) nothing of that name",
    408: "the body did not arrive within --request-body-timeout",
    413: "body larger than --payload-limit",
    415: "Content-Type is not application/json",
    422: "a field has the wrong type, is out of range, unknown, or not available yet",
    429: "more than --max-concurrent-requests in flight",
    503: "the engine is not running",
}

DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>Ember API</title>
<style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}
code,pre{background:#f4f4f4;padding:.1rem .3rem}pre{padding:.6rem;overflow:auto}
h2{border-bottom:1px solid #ddd}.m{font-weight:bold;text-transform:uppercase;margin-right:.5rem}</style>
</head><body><h1>Ember API</h1><p>Machine-readable: <a href="/openapi.json">/openapi.json</a></p>
<div id="paths">loading...</div>
<script>
fetch('/openapi.json').then(r => r.json()).then(spec => {
  const root = document.getElementById('paths'); root.innerHTML = '';
  for (const [path, ops] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      const h = document.createElement('h2');
      h.innerHTML = '<span class="m">' + method + '</span><code>' + path + '</code> ' + op.summary;
      root.appendChild(h);
      const body = op.requestBody && op.requestBody.content['application/json'].schema['$ref'];
      if (body) {
        const name = body.split('/').pop();
        const pre = document.createElement('pre');
        pre.textContent = 'request ' + name + ': ' + JSON.stringify(spec.components.schemas[name], null, 2);
        root.appendChild(pre);
      }
      const codes = Object.keys(op.responses).join(', ');
      const p = document.createElement('p'); p.textContent = 'responses: ' + codes; root.appendChild(p);
    }
  }
});
</script></body></html>
"""


class OpenAPIRoutes:
    def __init__(self, routes: list[Route]) -> None:
        import ember

        self._spec = build_openapi(routes, ember.__version__)

    def routes(self) -> list[Route]:
        return [
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/docs", self.docs, methods=["GET"]),
        ]

    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(self._spec)

    async def docs(self, request: Request) -> HTMLResponse:
        return HTMLResponse(DOCS_HTML)
