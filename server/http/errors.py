"""Every error leaves the server in OpenAI's shape: {"error": {"message", "type", "param", "code"}} (on the Anthropic
routes, /v1/messages*, server/api/anthropic/errors.py rewrites it into Anthropic's shape, same status).

Handlers here turn RequestError, pydantic validation errors (400, not FastAPI's 422), routing errors
(404/405) and anything unexpected (500) into that shape, so clients see one error format everywhere.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierlm.runtime.errors import RequestError
from tierlm.runtime.sampling_params import SamplingParamsError
from tierlm.server.pipeline.generation import EngineFailure

logger = logging.getLogger("tierlm.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


def error_body(message: str, status: int = 400, type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    err_type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(message: str, status: int = 400, type: str | None = None, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, type, param, code), status_code=status, headers=headers)


async def send_error(send: Send, message: str, status: int, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer from an ASGI middleware (before any route runs) with an error in OpenAI's shape."""
    body = json.dumps(error_body(message, status, code=code)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def request_error_body(e: RequestError) -> dict[str, Any]:
    return error_body(e.message, e.status, e.type, e.param, e.code)


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    # pydantic names the member of a union a value failed in (``function-after[...]``, ``list[str]``): not a field
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header") and "[" not in str(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence for the first problem (and how many more), plus the field it names."""
    if not errors:
        return "invalid request", None
    # A value that fails every member of a union fails each differently; the member of its own type says why.
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing" and not param:
        text = "request body is missing: send a JSON object"
    elif not param and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        text = "the request body must be a JSON object; send it with 'Content-Type: application/json'"
    elif first.get("type") == "extra_forbidden":
        text = f"unknown field '{param}'"
    else:
        text = f"{param}: {msg}" if param else msg
    more = len({_loc_to_param(tuple(e.get("loc", ()))) for e in errors}) - 1
    if more > 0:
        text += f" (and {more} more invalid field{'s' if more > 1 else ''})"
    return text, param or None


async def _handle_request_error(request: Request, e: RequestError) -> JSONResponse:
    if e.status >= 500 and e.status != 503:  # 503 is "still loading": expected, not worth an error line
        logger.error("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
    return JSONResponse(request_error_body(e), status_code=e.status)


async def _handle_sampling_error(request: Request, e: SamplingParamsError) -> JSONResponse:
    return error_response(str(e), 400, param=e.param)


async def _handle_engine_failure(request: Request, e: EngineFailure) -> JSONResponse:
    logger.error("%s %s -> 500: generation failed: %s", request.method, request.url.path, e)
    return error_response(f"generation failed: {e}", 500)


async def _handle_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    text, param = validation_message(list(e.errors()))
    return error_response(text, 400, param=param)


async def _handle_http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
    if e.status_code == 404:
        text = f"unknown route {request.method} {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions, /generate"
    elif e.status_code == 405:
        allowed = (e.headers or {}).get("allow") or (e.headers or {}).get("Allow") or ""
        text = f"method {request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
    elif isinstance(e.__cause__, RecursionError):  # FastAPI's "error parsing the body" of a body nested too deep
        text = (f"the request body nests JSON objects and arrays deeper than this server parses (Python's recursion "
                f"limit, {sys.getrecursionlimit()} levels less the parser's own calls); keep nesting under 500 levels")
    else:
        text = str(e.detail)
    code = "request_too_large" if e.status_code == 413 else None
    return error_response(text, e.status_code, code=code, headers=dict(e.headers) if e.headers else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, _handle_request_error)  # type: ignore[arg-type]
    app.add_exception_handler(SamplingParamsError, _handle_sampling_error)  # type: ignore[arg-type]
    app.add_exception_handler(EngineFailure, _handle_engine_failure)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _handle_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)  # type: ignore[arg-type]
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Turn an unexpected exception into a 500 in OpenAI shape and keep serving.

    Starlette's own 500 path re-raises after responding, which logs twice and breaks test clients; this
    one logs the traceback once. If the response had already started (a stream), it just closes it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - this is the last line of defence
            if isinstance(e, ClientDisconnect) or (started and isinstance(e, OSError)):
                # The client went away; the stream's cleanup has already aborted its engine requests.
                logger.info("client disconnected during %s %s", scope.get("method"), scope.get("path"))
                return
            logger.exception("internal error while serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                try:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
                    pass
                return
            body = json.dumps(error_body(f"internal server error: {type(e).__name__}: {e}", 500)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
