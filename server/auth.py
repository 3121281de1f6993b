"""--api-key: API routes need 'Authorization: Bearer <key>'; health checks and metrics stay open (as in SGLang)."""
from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from tierlm.server.http_errors import error_body

OPEN_PATHS = ("/health", "/health_generate", "/metrics")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return secrets.compare_digest(value.strip(), self.expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            "missing or invalid API key: send 'Authorization: Bearer <key>' with the key the server was started "
            "with (--api-key)", 401, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
