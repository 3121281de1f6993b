"""The runtime's errors: RequestError (a client's fault, with the HTTP status and OpenAI error fields) and
StartupError (the server cannot start as configured; the message says what to change)."""
from __future__ import annotations


class RequestError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says what to change."""
