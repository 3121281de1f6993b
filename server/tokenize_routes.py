"""POST /tokenize and /detokenize in vLLM's and SGLang's shapes (text or chat messages -> ids, ids -> text)."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI, Tokenizer
from tierlm.runtime.errors import RequestError
from tierlm.server.chat_tools import template_messages
from tierlm.server.deps import check_model, ready_engine
from tierlm.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from tierlm.server.tokenization import apply_chat_template, check_text, decode_ids, encode_text, off_loop

router = APIRouter()


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return encode_text(tokenizer, text)
    check_text(text, "prompt")
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("send exactly one of 'prompt' (text) or 'messages' (chat)", 400, param="prompt")
    if body.messages is not None:
        ids = await off_loop(apply_chat_template, engine.tokenizer, template_messages(body.messages),
                             body.chat_template_kwargs)
    else:
        ids = await off_loop(_encode, engine.tokenizer, body.prompt, body.add_special_tokens)
    return JSONResponse(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.context_length)
                        .model_dump())


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    engine.check_token_ids(body.tokens, "tokens")
    text = await off_loop(decode_ids, engine.tokenizer, body.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
