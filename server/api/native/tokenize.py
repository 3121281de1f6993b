"""POST /tokenize and /detokenize (also at SGLang's /v1/ paths) in vLLM's and SGLang's shapes: text, a list of
texts or chat messages -> ids; ids or a list of id lists -> text."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.server.api.native.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from tierlm.server.deps import check_model, ready_engine
from tierlm.server.pipeline.tokenization import (TemplatePolicy, apply_chat_template, check_text, decode_ids,
                                                 encode_text, off_loop)
from tierlm.server.pipeline.tools import template_messages

router = APIRouter()


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return encode_text(tokenizer, text)
    check_text(text, "prompt")
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]


@router.post("/v1/tokenize", response_model=None, include_in_schema=False)  # SGLang's path; same route
@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("send exactly one of 'prompt' (text) or 'messages' (chat)", 400, param="prompt")
    ids: list[int] | list[list[int]]
    count: int | list[int]
    if body.messages is not None:
        ids = await off_loop(apply_chat_template, engine.tokenizer, template_messages(body.messages),
                             body.chat_template_kwargs, TemplatePolicy.of(engine.args), body.chat_template)
        count = len(ids)
    elif isinstance(body.prompt, list):  # SGLang: a list of texts -> a list of id lists and of counts
        ids = [await off_loop(_encode, engine.tokenizer, text, body.add_special_tokens) for text in body.prompt]
        count = [len(one) for one in ids]
    else:
        ids = await off_loop(_encode, engine.tokenizer, body.prompt, body.add_special_tokens)
        count = len(ids)
    return JSONResponse(TokenizeResponse(tokens=ids, count=count, max_model_len=engine.context_length)
                        .model_dump())


def _decode(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    if not skip_special_tokens:
        return decode_ids(tokenizer, ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


@router.post("/v1/detokenize", response_model=None, include_in_schema=False)  # SGLang's path; same route
@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    text: str | list[str]
    if body.tokens and isinstance(body.tokens[0], list):  # SGLang: a list of id lists -> a list of texts
        for i, one in enumerate(body.tokens):
            engine.check_token_ids(one, f"tokens[{i}]")  # type: ignore[arg-type]
        text = [await off_loop(_decode, engine.tokenizer, one, body.skip_special_tokens) for one in body.tokens]
    else:
        engine.check_token_ids(body.tokens, "tokens")
        text = await off_loop(_decode, engine.tokenizer, body.tokens, body.skip_special_tokens)
    # SGLang answers {"text": ...}, vLLM {"prompt": ...}: both keys, the same text
    return JSONResponse(DetokenizeResponse(text=text, prompt=text).model_dump())
