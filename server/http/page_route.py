"""The web page at /: static files shipped in the package (server/http/page/), no CDN and no build step.

The files themselves are open (a browser's navigation cannot send an API key, and they hold no data); everything
the page shows comes from the API (/tiers, /v1/chat/completions, ...), which the page calls with the key the user
types once (auth.py guards those routes as for any client). A strict Content-Security-Policy keeps the page to its
own origin: no inline script, no third-party anything.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from tierlm.runtime.errors import RequestError

router = APIRouter()
PAGE_DIR = Path(__file__).resolve().parent / "page"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/", *(f"/page/{name}" for name in ASSETS))  # open paths (auth.py): the files hold no data
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new tierlm version's page replaces the old one at once
}


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: Claude Code probes it
async def index() -> FileResponse:
    return FileResponse(PAGE_DIR / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/page/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:  # a fixed list: nothing else under the package is reachable
        raise RequestError(f"no page file named '{name}'", 404, code="not_found", type="not_found_error")
    return FileResponse(PAGE_DIR / name, media_type=ASSETS[name], headers=HEADERS)
