"""The web playground (docs/playground.md): `/` and `/ui` serve its page, `/ui/app.js`
and `/ui/style.css` its script and style sheet, all shipped as package data
(`ember/api/playground/`) and read once when the app is built; any other `/ui/NAME` is
the app's usual 404.

The page names everything relative to a ``<base href>`` set to the request's
``root_path`` (`--root-path`, or the prefix a parent app mounted Ember under), so its
assets and its API calls follow the server behind a reverse proxy's path prefix. The
assets are referred to with their content hash (``?v=...``): the page itself is
revalidated on each load (``no-cache`` and an ETag), the assets are cached for a year.
A Content-Security-Policy keeps the page to its own origin: it fetches nothing else.
"""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.api.openapi import documented

ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/", "/ui")
BASE_MARKER = "{{base}}"
ASSET_CACHE = "public, max-age=31536000, immutable"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'self'; form-action 'none'; frame-ancestors 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str  # quoted, as the header carries it


def _asset(body: bytes, media_type: str) -> Asset:
    return Asset(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')


def load_assets() -> tuple[str, dict[str, Asset]]:
    """The page's template (its asset links carrying their hashes) and the assets."""
    folder = resources.files("ember.api") / "playground"
    assets = {name: _asset((folder / name).read_bytes(), media) for name, media in ASSETS.items()}
    page = (folder / "index.html").read_text("utf-8")
    for name, asset in assets.items():
        page = page.replace(f'"ui/{name}"', f'"ui/{name}?v={asset.etag.strip(chr(34))}"')
    return page, assets


def _not_modified(request: Request, asset: Asset) -> bool:
    given = request.headers.get("if-none-match")
    return given is not None and asset.etag in {tag.strip() for tag in given.split(",")}


class PlaygroundRoutes:
    def __init__(self) -> None:
        self.page, self.assets = load_assets()

    def routes(self) -> list[Route]:
        """The page at each of `PAGE_PATHS`, each asset at ``/ui/NAME`` (any other name is
        the app's usual 404)."""
        return [Route(path, self.index, methods=["GET", "HEAD"]) for path in PAGE_PATHS] + [
            Route(f"/ui/{name}", self._asset_endpoint(name), methods=["GET", "HEAD"]) for name in self.assets
        ]

    @documented(summary="The web playground (docs/playground.md)", tag="Playground", text_media_type="text/html")
    async def index(self, request: Request) -> Response:
        """The page, its base the app's root as the browser sees it (``root_path`` + "/")."""
        base = html.escape(request.scope.get("root_path", "").rstrip("/") + "/", quote=True)
        page = _asset(self.page.replace(BASE_MARKER, base).encode("utf-8"), "text/html; charset=utf-8")
        return self._respond(request, page, "no-cache")

    def _asset_endpoint(self, name: str):
        asset = self.assets[name]

        async def serve(request: Request) -> Response:
            return self._respond(request, asset, ASSET_CACHE)

        media_type = asset.media_type.split(";", 1)[0]
        return documented(summary=f"The playground's {name}", tag="Playground", text_media_type=media_type)(serve)

    @staticmethod
    def _respond(request: Request, asset: Asset, cache_control: str) -> Response:
        headers = {**SECURITY_HEADERS, "Cache-Control": cache_control, "ETag": asset.etag}
        if _not_modified(request, asset):
            return Response(status_code=304, headers=headers)
        return Response(asset.body, media_type=asset.media_type, headers=headers)
