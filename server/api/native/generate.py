"""POST /generate: SGLang's native API. {text | input_ids, sampling_params, stream} -> {text, output_ids, meta_info}.

A list of prompts is a batch (one result per prompt, non-streaming only). Streaming sends cumulative text
and output ids in every event, as SGLang does, then `data: [DONE]`.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.server.api.native.protocol import NativeGenerateRequest
from tierlm.server.deps import make_request, ready_engine
from tierlm.server.pipeline.generation import ChoiceResult, collect_outputs, stream_choices, unless_disconnected
from tierlm.server.pipeline.logprob_format import NativeLogprobs
from tierlm.server.pipeline.sampling_mapping import native_sampling_params, with_native_logprobs
from tierlm.server.pipeline.sse import DONE, EventStreamResponse, sse_data
from tierlm.server.pipeline.structured_output import check_grammars
from tierlm.server.pipeline.tokenization import encode_text, off_loop

router = APIRouter()


def _prompts(engine: EngineAPI, body: NativeGenerateRequest) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the request is a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("send exactly one of 'text' or 'input_ids'", 400, param="text")
    if body.text is not None:
        if isinstance(body.text, str):
            return [encode_text(engine.tokenizer, body.text, "text")], False
        return [encode_text(engine.tokenizer, t, f"text[{i}]") for i, t in enumerate(body.text)], True
    ids = body.input_ids or []
    if ids and isinstance(ids[0], list):
        return [list(p) for p in ids], True  # type: ignore[arg-type]
    return [list(ids)], False  # type: ignore[arg-type]


def _rids(body: NativeGenerateRequest, count: int) -> list[str]:
    if body.rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    rids = [body.rid] if isinstance(body.rid, str) else list(body.rid)
    if len(rids) != count:
        raise RequestError(f"'rid' has {len(rids)} ids for {count} prompts", 400, param="rid")
    return rids


@router.post("/generate", response_model=None)
async def generate(body: NativeGenerateRequest, request: Request, engine: EngineAPI = Depends(ready_engine)) -> Response:
    prompts, batch = await off_loop(_prompts, engine, body)
    if batch and body.stream:
        raise RequestError("streaming a batch is not supported; send one prompt per streaming request", 400,
                           param="stream")
    if batch and not prompts:
        raise RequestError("the prompt batch is empty", 400, param="text" if body.text is not None else "input_ids")
    param = "text" if body.text is not None else "input_ids"
    reqs = [make_request(engine, rid, ids, with_native_logprobs(native_sampling_params(body.sampling_params), body),
                         body.stream, param if not batch else f"{param}[{i}]")
            for i, (rid, ids) in enumerate(zip(_rids(body, len(prompts)), prompts))]
    await check_grammars(engine, reqs)  # a grammar that does not compile: 400 before anything is queued

    if body.stream:
        return EventStreamResponse(_events(request, engine, reqs[0], body))
    results = await unless_disconnected(request, lambda: collect_outputs(engine, reqs))
    outputs = [_result_dict(r, _native_logprobs(engine, body, r.final)) for r in results]
    return JSONResponse(outputs if batch else outputs[0])


def _native_logprobs(engine: EngineAPI, body: NativeGenerateRequest, out: GenerateOutput | None = None
                     ) -> NativeLogprobs | None:
    if not body.return_logprob:
        return None
    lp = NativeLogprobs(engine.tokenizer, body.return_text_in_logprobs, body.top_logprobs_num)
    if out is not None:
        lp.add(out.logprobs)
    return lp


def _meta_info(out: GenerateOutput, logprobs: NativeLogprobs | None) -> dict[str, Any]:
    info = out.meta_info()
    if logprobs is not None:
        info.update(logprobs.meta_info())
    return info


def _result_dict(r: ChoiceResult, logprobs: NativeLogprobs | None) -> dict[str, Any]:
    assert r.final is not None
    return {"text": r.text, "output_ids": r.token_ids, "meta_info": _meta_info(r.final, logprobs)}


async def _events(request: Request, engine: EngineAPI, req: GenerateRequest, body: NativeGenerateRequest
                  ) -> AsyncIterator[bytes]:
    """SGLang's stream: each event carries the whole text and ids (and logprobs) so far, then [DONE]."""
    acc = ChoiceResult()
    logprobs = _native_logprobs(engine, body)
    finals: list[GenerateOutput | None] = [None]
    async with aclosing(stream_choices(request, engine, [req], finals)) as choices:
        async for _, out in choices:
            acc.add(out)
            if logprobs is not None:
                logprobs.add(out.logprobs)
            if out.text or out.token_ids or out.finished:
                yield sse_data({"text": acc.text, "output_ids": acc.token_ids,
                                "meta_info": _meta_info(out, logprobs)})
    if finals[0] is None:
        return  # the client is gone
    yield DONE
