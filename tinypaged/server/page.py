"""The playground page at GET /: plain HTML, CSS and JS shipped in the package (`server/static/`), no build step.

The page is public, like /health: it holds no secret. The API calls it makes carry the key its user types,
kept in the tab's sessionStorage. Its Content-Security-Policy lets it load and call nothing but this origin
and run no inline script, so neither a CDN nor model text can ever run code in it (the page writes model text
with textContent anyway).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
# URL path -> (file in static/, content type).
PAGE_FILES = {
    "/": ("index.html", "text/html"),
    "/playground.css": ("playground.css", "text/css"),
    "/playground.js": ("playground.js", "text/javascript"),
    "/kv-view.js": ("kv-view.js", "text/javascript"),
}
PAGE_PATHS = frozenset(PAGE_FILES)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def page_routes() -> list[web.RouteDef]:
    """GET routes for the page's files, read once."""

    def route(path: str, name: str, content_type: str) -> web.RouteDef:
        body = (STATIC / name).read_bytes()
        headers = {
            "Content-Security-Policy": CSP,
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        }

        async def handler(request: web.Request) -> web.StreamResponse:
            return web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)

        handler.__doc__ = f"GET {path}: {name}."
        return web.get(path, handler)

    return [route(path, name, ctype) for path, (name, ctype) in PAGE_FILES.items()]
