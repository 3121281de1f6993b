"""The FastAPI app factory. Takes any EngineAPI (runtime/engine_api.py), so tests can pass a fake engine."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tierlm.runtime.engine_api import EngineAPI
from tierlm.server.api.anthropic.errors import AnthropicErrorMiddleware
from tierlm.server.api.anthropic.messages import router as anthropic_router
from tierlm.server.api.native.generate import router as native_router
from tierlm.server.api.native.infill import router as infill_router
from tierlm.server.api.native.info import router as info_router
from tierlm.server.api.native.tiers import router as tiers_router
from tierlm.server.api.native.tokenize import router as tokenize_router
from tierlm.server.api.openai.chat import router as chat_router
from tierlm.server.api.openai.completions import router as completions_router
from tierlm.server.api.responses.routes import router as responses_router
from tierlm.server.http.auth import ApiKeyMiddleware
from tierlm.server.http.body_limit import BodyLimitMiddleware
from tierlm.server.http.cors import CorsMiddleware
from tierlm.server.http.errors import install_error_handlers
from tierlm.server.http.openapi_doc import install_openapi
from tierlm.server.http.origin_guard import OriginGuardMiddleware
from tierlm.server.http.page_route import router as page_router
from tierlm.server.http.request_log import RequestLogMiddleware

logger = logging.getLogger("tierlm.server")


def create_app(engine: EngineAPI, *, shutdown_engine_on_exit: bool = False) -> FastAPI:
    """Routes: OpenAI /v1/*, SGLang-native /generate, health, info, flush_cache, metrics, /tiers and the page at /."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGINT/SIGTERM after its own shutdown, so code after server.run() may never
        # run: the app's shutdown is the reliable place to stop the scheduler thread.
        if shutdown_engine_on_exit and engine.ready:
            logger.info("stopping the engine")
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway; say what went wrong
                logger.exception("engine shutdown failed")

    app = FastAPI(title="tierlm", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    for router in (chat_router, completions_router, responses_router, native_router, info_router, tokenize_router,
                   tiers_router, page_router):
        app.include_router(router)
    app.include_router(anthropic_router)  # POST /v1/messages, /v1/messages/count_tokens
    app.include_router(infill_router)  # POST /infill, llama.cpp's fill-in-the-middle
    install_error_handlers(app)
    install_openapi(app)  # the document as the server behaves: statuses, error shape, media types
    # Middleware runs outermost-last-added: log -> CORS -> body limit -> origin guard -> API keys -> routes
    # (CORS outside the rest: preflights need no key, and every answer to an allowed origin gets its header).
    args = engine.args
    if args.api_key or args.admin_api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, admin_api_key=args.admin_api_key)
    app.add_middleware(OriginGuardMiddleware, bind_host=args.host, allowed_origins=list(args.allowed_origins))
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_bytes)
    app.add_middleware(AnthropicErrorMiddleware)  # errors on /v1/messages* in Anthropic's shape, whoever wrote them
    app.add_middleware(CorsMiddleware, allowed_origins=list(args.allowed_origins))
    app.add_middleware(RequestLogMiddleware, log_bodies=args.log_requests)
    return app
