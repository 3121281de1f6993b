"""What route handlers share: the engine (503 until loaded), request ids, and building checked engine requests."""
from __future__ import annotations

import uuid
from collections.abc import Sequence

from fastapi import Request

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import GenerateRequest, PinRequest
from tierlm.runtime.sampling_params import SamplingParams


def engine_of(request: Request) -> EngineAPI:
    return request.app.state.engine


def ready_engine(request: Request) -> EngineAPI:
    """FastAPI dependency: the engine, or 503 while the model is still loading."""
    engine = engine_of(request)
    if not engine.ready:
        raise RequestError("the model is still loading; retry when GET /health returns 200", 503,
                           code="model_not_ready", type="service_unavailable_error")
    return engine


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def sub_rid(base: str, i: int, count: int) -> str:
    """The engine request id of choice i; a lone choice keeps the response id itself."""
    return base if count == 1 else f"{base}-{i}"


def make_request(engine: EngineAPI, rid: str, input_ids: list[int], params: SamplingParams, stream: bool,
                 prompt_param: str = "prompt", pins: Sequence[PinRequest] = ()) -> GenerateRequest:
    """A GenerateRequest the engine has accepted (engine.validate raises RequestError otherwise), with its
    prompt-caching ``pins`` (server/pipeline/pins.py).

    This is the one validation path for prompt token ids (vocabulary, context length): every endpoint builds
    its requests here before anything else (echo, logging) reads the ids."""
    req = GenerateRequest(rid=rid, input_ids=input_ids, sampling_params=params, stream=stream, pins=list(pins))
    try:
        engine.validate(req)
    except RequestError as e:
        if e.param == "prompt":
            e.param = prompt_param
        raise
    return req


def model_name(engine: EngineAPI) -> str:
    return engine.args.model_name


def served_names(engine: EngineAPI) -> set[str]:
    """Names a request may put in 'model': the served name, the model path, and the alias 'default'."""
    args = engine.args
    return {n for n in (args.model_name, args.model_path, "default") if n}


def check_model(engine: EngineAPI, requested: str | None) -> None:
    """404 in OpenAI's shape for a model this server does not serve (as GET /v1/models/{id} answers)."""
    if requested and requested not in served_names(engine):
        raise RequestError(f"model '{requested}' does not exist; this server serves '{model_name(engine)}' "
                           f"(see GET /v1/models)", 404, param="model", code="model_not_found",
                           type="not_found_error")
