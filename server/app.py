"""The FastAPI app factory. Takes any object with the Engine API, so tests can pass a fake engine."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tierlm.server.auth import ApiKeyMiddleware
from tierlm.server.http_errors import install_error_handlers
from tierlm.server.info_routes import router as info_router
from tierlm.server.native_generate import router as native_router
from tierlm.server.openai_chat import router as chat_router
from tierlm.server.openai_completions import router as completions_router


def create_app(engine: Any) -> FastAPI:
    """Routes: OpenAI /v1/*, SGLang-native /generate, health, info, flush_cache, metrics.

    ``engine`` needs: args (ServerArgs), ready, tokenizer, context_length, validate, generate, abort,
    flush_cache, server_info, metrics_text.
    """
    app = FastAPI(title="tierlm", docs_url="/docs", redoc_url=None)
    app.state.engine = engine
    for router in (chat_router, completions_router, native_router, info_router):
        app.include_router(router)
    install_error_handlers(app)
    if engine.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=engine.args.api_key)
    return app
