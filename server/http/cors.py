"""CORS for the web origins named in --allowed-origins ('*': any), so a browser app on another origin can call the API.

A browser sends a preflight (OPTIONS with Access-Control-Request-Method) before a cross-origin POST with a JSON body
or an Authorization header; it carries no credentials, so it is answered here, before the API-key check. Every
other response to an allowed origin (200s, errors from any layer, SSE streams) gets Access-Control-Allow-Origin,
or the page could not read it. Origins not listed pass through untouched: the origin guard (server/http/origin_guard.py)
refuses them as before, and without CORS headers the browser hides even that refusal from the page.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
# Request headers are not restricted (as vLLM's allow_headers=["*"] and llama.cpp): the operator trusts the origin,
# auth is checked on the request itself, and an SDK adding a header of its own must not break a page. These are
# always named too, for caches of a preflight that asked for fewer.
ALLOW_HEADERS = ("authorization", "content-type", "accept", "x-api-key", "anthropic-version", "anthropic-beta",
                 "anthropic-dangerous-direct-browser-access", "openai-beta")
EXPOSE_HEADERS = "content-type, www-authenticate, x-request-id"
MAX_AGE_S = "600"  # browsers cache the preflight answer this long (Chromium caps it at 7200)


def _merged_vary(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The response's headers with Origin added to its Vary (caches must not serve one origin's answer to another)."""
    vary = [v for k, v in headers if k.lower() == b"vary"]
    kept = [(k, v) for k, v in headers if k.lower() != b"vary"]
    return [*kept, (b"vary", b", ".join([*vary, b"Origin"]))]


class CorsMiddleware:
    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.any_origin = "*" in allowed_origins
        # host-only entries (no scheme) name the server for the Host check; they are not web origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if "://" in o}

    def _allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        origin = headers.get("origin")
        if origin is None or not self._allowed(origin):
            await self.app(scope, receive, send)  # same-origin, not a browser, or an origin the guard refuses
            return
        allow_origin = (b"access-control-allow-origin", origin.encode("latin-1"))
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(scope, send, headers, [allow_origin, (b"vary", b"Origin")])
            return

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*_merged_vary(message.get("headers", [])), allow_origin,
                                                   (b"access-control-expose-headers", EXPOSE_HEADERS.encode())]}
            await send(message)

        await self.app(scope, receive, with_cors)

    async def _preflight(self, scope: Scope, send: Send, headers: dict[str, str],
                         cors: list[tuple[bytes, bytes]]) -> None:
        requested = [h.strip().lower() for h in headers.get("access-control-request-headers", "").split(",")
                     if h.strip()]
        out = [*cors, (b"access-control-allow-methods", ALLOW_METHODS.encode()),
               (b"access-control-allow-headers",
                ", ".join(dict.fromkeys([*ALLOW_HEADERS, *requested])).encode("latin-1")),
               (b"access-control-max-age", MAX_AGE_S.encode()), (b"content-length", b"0")]
        if headers.get("access-control-request-private-network") == "true":
            out.append((b"access-control-allow-private-network", b"true"))  # Chromium: a public page calling localhost
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})
