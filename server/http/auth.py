"""API keys. --api-key: API routes need 'Authorization: Bearer <key>' (or Anthropic's 'x-api-key: <key>'); health
checks and metrics stay open (as in SGLang). --admin-api-key: admin routes (those that change server state, e.g.
/flush_cache) need that key instead; without it they need --api-key when one is set."""
from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from tierlm.server.http.errors import send_error
from tierlm.server.http.page_route import PAGE_PATHS  # the page's files: a browser loads them without a key

OPEN_PATHS = ("/health", "/health_generate", "/metrics")
ADMIN_PATHS = ("/flush_cache",)


def _sent_keys(scope: Scope) -> list[bytes]:
    """The keys a request sends: 'Authorization: Bearer <key>', or Anthropic's 'x-api-key: <key>'."""
    keys = []
    for name, value in scope.get("headers", []):
        if name == b"authorization" and value.strip().startswith(b"Bearer "):
            keys.append(value.strip()[len(b"Bearer "):].strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


def _matches(sent: list[bytes], key: str | None) -> bool:
    return key is not None and any(secrets.compare_digest(k, key.encode()) for k in sent)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def _required(self, path: str) -> tuple[str | None, str]:
        """(the key this path needs, the flag that set it); no key -> open."""
        if path in OPEN_PATHS or path in PAGE_PATHS:
            return None, ""
        if path in ADMIN_PATHS and self.admin_api_key:
            return self.admin_api_key, "--admin-api-key"
        return self.api_key, "--api-key"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key, flag = self._required(scope["path"])
        if key is None or _matches(_sent_keys(scope), key):
            await self.app(scope, receive, send)
            return
        await send_error(send, f"missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                               f"<key>') with the key the server was started with ({flag})", 401, code="invalid_api_key",
                         headers=[(b"www-authenticate", b"Bearer")])
