"""Health, model listing, server info, load, version, cache flush and Prometheus metrics."""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.server.api.native.protocol import RankLoad, VersionResponse
from tierlm.server.api.openai.protocol import ModelCard, ModelList
from tierlm.server.deps import engine_of, make_request, model_name, ready_engine, served_names
from tierlm.server.http.errors import error_response
from tierlm.server.pipeline.generation import collect_outputs
from tierlm.server.pipeline.sampling_mapping import build_sampling_params
from tierlm.server.pipeline.tokenization import encode_text

logger = logging.getLogger("tierlm.server")
router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 30.0


@router.get("/health")
async def health(request: Request) -> Response:
    if not engine_of(request).ready:
        return error_response("the model is still loading", 503, code="model_not_ready")
    return JSONResponse({"status": "ok"})


@router.get("/health_generate")
async def health_generate(engine: EngineAPI = Depends(ready_engine)) -> Response:
    """Healthy only if the engine really produces a token (catches a stuck scheduler)."""
    ids = encode_text(engine.tokenizer, "Hello")[:4] or [0]
    req = make_request(engine, f"health-{uuid.uuid4().hex}", ids,
                       build_sampling_params(max_new_tokens=1, temperature=0.0), stream=False)
    try:
        await asyncio.wait_for(collect_outputs(engine, [req]), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.error("health_generate: no token within %.0f s; the scheduler may be stuck", HEALTH_GENERATE_TIMEOUT_S)
        return error_response(f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503, code="unhealthy")
    return JSONResponse({"status": "ok"})


def _model_card(engine: EngineAPI) -> ModelCard:
    context = engine.context_length if engine.ready else engine.args.context_length
    return ModelCard(id=model_name(engine), root=engine.args.model_path, max_model_len=context or None)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return JSONResponse(ModelList(data=[_model_card(engine_of(request))]).model_dump())


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    engine = engine_of(request)
    if model_id not in served_names(engine):
        raise RequestError(f"model '{model_id}' does not exist; this server serves '{model_name(engine)}'", 404,
                           param="model", code="model_not_found", type="not_found_error")
    return JSONResponse(_model_card(engine).model_dump())


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    """SGLang's shape. sglang-router asks /model_info first (then /get_model_info) and labels the worker with
    model_type and architectures (docs/scale-out.md)."""
    engine = engine_of(request)
    args = engine.args
    body = {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "served_model_name": args.model_name,
        "is_generation": True,
    }
    architecture = engine.server_info().get("architecture") if engine.ready else None
    if architecture:
        body["architectures"] = [architecture]
    return JSONResponse(body)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(engine: EngineAPI = Depends(ready_engine)) -> Response:
    """tierlm's report, plus SGLang's top-level copies of the server args (SGLang puts them at the top level;
    sglang-router reads model_path, served_model_name, tp_size and dp_size there). Keys the report already has
    at the top level (model_path: the resolved path, max_running_requests, ...) keep tierlm's value; the nested
    ``server_args`` stays as it was. served_model_name is the name requests must use, as in SGLang, where it
    defaults to the model path: sglang-router registers the worker under it."""
    info = engine.server_info()
    for key, value in info.get("server_args", {}).items():
        info.setdefault(key, value)
    info["served_model_name"] = model_name(engine)
    return JSONResponse(info)


@router.get("/get_load")
async def get_load(engine: EngineAPI = Depends(ready_engine)) -> Response:
    """SGLang's shape: one entry per data-parallel rank (tierlm runs one); ts_tic is time.perf_counter() as in
    SGLang (docs/api.md)."""
    load = await engine.get_load()
    return JSONResponse([RankLoad(dp_rank=0, **load, ts_tic=time.perf_counter()).model_dump()])


@router.get("/version")
async def version() -> Response:
    return JSONResponse(VersionResponse(version=tierlm_version()).model_dump())


def tierlm_version() -> str:
    try:
        return importlib.metadata.version("tierlm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@router.post("/flush_cache")
async def flush_cache(storage: bool = False, engine: EngineAPI = Depends(ready_engine)) -> Response:
    flushed = await engine.flush_cache(storage=storage)
    if not flushed:
        raise RequestError("cache not flushed: requests are still running; retry when the server is idle", 400,
                           code="cache_busy")
    message = "cache flushed" + (", storage tier included" if storage else "")
    logger.info("%s (requested over HTTP)", message)
    return JSONResponse({"success": True, "message": message})


@router.get("/metrics")
async def metrics(engine: EngineAPI = Depends(ready_engine)) -> Response:
    return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)
