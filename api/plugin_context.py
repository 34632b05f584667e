"""The API's side of the ``ember_api_routes`` hook: `PluginRouteContext`, what a
plugin's routes may use (the contract: `ember.plugin.hookspecs.RouteContext`), and
`plugin_routes`, which collects those routes once, when the app is built."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.api.errors import APIError, Flavor, error_response, validation_error
from ember.api.http import read_model
from ember.api.openapi import documented
from ember.api.service import GenerationService
from ember.engine.client import EngineClient
from ember.plugin.hookspecs import RouteContext

T = TypeVar("T")


class PluginRouteContext(RouteContext):
    """`RouteContext` over the app's `GenerationService`."""

    def __init__(self, service: GenerationService) -> None:
        self._service = service

    @property
    def client(self) -> EngineClient:
        return self._service.client

    @property
    def max_input_tokens(self) -> int:
        return self._service.limits.max_input_tokens

    @property
    def max_total_tokens(self) -> int:
        return self._service.limits.max_total_tokens

    def route(
        self, path: str, endpoint: Callable[[Request], Awaitable[Any]], *, methods: Sequence[str] = ("POST",),
        summary: str | None = None, tag: str = "Plugins", request_model: type | None = None,
    ) -> Route:
        flavor = Flavor.OPENAI if path.startswith("/v1/") else Flavor.TGI

        @functools.wraps(endpoint)
        async def answer(request: Request) -> Response:
            try:
                result = await endpoint(request)
            except APIError as exc:
                return error_response(exc, flavor)
            return result if isinstance(result, Response) else JSONResponse(result)

        if summary is not None:
            documented(summary=summary, tag=tag, request=request_model)(answer)
        return Route(path, answer, methods=list(methods))

    async def read_body(self, request: Request, model: type[T]) -> T:
        return await read_model(request, model)

    def validation_error(self, message: str, param: str | None = None) -> APIError:
        return validation_error(message, param)

    def check_chars(self, text: str, input_name: str, max_tokens: int | None = None) -> None:
        self._service.check_chars(text, input_name, max_tokens)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._service.run_blocking(fn, *args)


def plugin_routes(service: GenerationService, taken: set[str]) -> list[Route]:
    """The routes plugins add through ``ember_api_routes``; a path already in ``taken``
    (a built-in route's, or another plugin's) is an error."""
    added = []
    context = PluginRouteContext(service)
    for plugin_list in service.client.plugin_manager.hook.ember_api_routes(context=context):
        for route in plugin_list or ():
            if route.path in taken:
                raise ValueError(f"a plugin's route {route.path!r} clashes with a route the app already has")
            taken.add(route.path)
            added.append(route)
    return added
