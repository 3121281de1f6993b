"""POST /v1/chat/completions: messages -> chat template -> generation, n choices, optional SSE streaming."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.server.chat_parsing.base import OutputParser, ParsedDelta
from tierlm.server.chat_parsing.reasoning import needs_special_tokens, prompt_opens_thinking, reasoning_parser_for
from tierlm.server.chat_tools import (apply_tool_grammar, delta_tool_calls, keeps_special_tokens, message_tool_calls,
                                      template_messages, template_tools, tool_finish_reason, tool_plan)
from tierlm.server.deps import check_model, make_request, model_name, new_id, ready_engine, sub_rid
from tierlm.server.generation import (collect_outputs, finish_reason_of, stream_choices, summed_usage,
                                      unless_disconnected)
from tierlm.server.logprob_format import Pieces, chat_logprob_content
from tierlm.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                    ChatCompletionResponse, ChatDelta, ChatMessageOut, make_usage)
from tierlm.server.sampling_mapping import chat_max_tokens, openai_sampling_params, reject_unsupported_chat
from tierlm.server.sse import DONE, EventStreamResponse, sse_data
from tierlm.server.structured_output import check_grammars
from tierlm.server.tokenization import TemplatePolicy, apply_chat_template, off_loop

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 engine: EngineAPI = Depends(ready_engine)) -> Response:
    check_model(engine, body.model)
    reject_unsupported_chat(body)
    plan = tool_plan(engine, body)  # tools, tool_choice (server/chat_tools.py)
    ids = await off_loop(apply_chat_template, engine.tokenizer, template_messages(body.messages),
                         {**template_kwargs(body), **template_tools(body)}, TemplatePolicy.of(engine.args),
                         body.chat_template)
    max_new_tokens = chat_max_tokens(body, len(ids), engine.context_length)
    response_id = new_id("chatcmpl-")
    reasoning = [output_parser(engine, body, ids) for _ in range(body.n)]  # one per choice: they keep state
    keep_special = reasoning[0] is not None and needs_special_tokens(
        engine.chat_format.reasoning_parser, engine.tokenizer.all_special_tokens)
    keep_special = keep_special or keeps_special_tokens(plan, engine.tokenizer)
    parsers = [plan.parser(r) for r in reasoning]  # reasoning, then tool calls over the content
    reqs: list[GenerateRequest] = []
    for c in range(body.n):
        params = apply_tool_grammar(openai_sampling_params(body, max_new_tokens, choice_index=c), plan)
        if keep_special:  # the parser needs the markers (harmony's are special tokens) and removes them itself
            params.skip_special_tokens = False
        reqs.append(make_request(engine, sub_rid(response_id, c, body.n), ids, params, body.stream))
    await check_grammars(engine, reqs)  # a grammar that does not compile: 400 before anything is queued

    if body.stream:
        return EventStreamResponse(_events(request, engine, reqs, body, response_id, parsers))

    results = await unless_disconnected(request, lambda: collect_outputs(engine, reqs))
    parsed = [parse_all(p, r.text) for p, r in zip(parsers, results)]
    response = ChatCompletionResponse(
        id=response_id,
        model=model_name(engine),
        choices=[ChatChoice(index=i, message=ChatMessageOut(content=d.content or (None if d.tool_calls else ""),
                                                            reasoning_content=d.reasoning or None,
                                                            tool_calls=message_tool_calls(d.tool_calls)),
                            finish_reason=tool_finish_reason(p, finish_reason_of(r.final)),
                            logprobs=_logprobs(body, Pieces(engine.tokenizer), r.final))
                 for i, (r, d, p) in enumerate(zip(results, parsed, parsers))],
        usage=make_usage(*summed_usage([r.final for r in results], body.n)),  # type: ignore[misc]
    )
    return JSONResponse(response.model_dump())


def template_kwargs(body: ChatCompletionRequest) -> dict:
    """chat_template_kwargs, plus reasoning_effort under that name (transformers' gpt-oss template reads it); a
    value in chat_template_kwargs wins."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def output_parser(engine: EngineAPI, body: ChatCompletionRequest, prompt_ids: list[int]) -> OutputParser | None:
    """A fresh parser for one choice: the server's reasoning parser (--reasoning-parser or the model's), with the
    request's separate_reasoning; qwen3 starts inside the thinking when the prompt already opened it."""
    name = engine.chat_format.reasoning_parser
    if not name:
        return None
    starts = None
    if name == "qwen3":
        starts = prompt_opens_thinking(engine.tokenizer.decode(prompt_ids[-16:]))
    return reasoning_parser_for(name, separate_reasoning=body.separate_reasoning,
                                stream_reasoning=body.stream_reasoning, starts_in_reasoning=starts)


def parse_all(parser: OutputParser | None, text: str) -> ParsedDelta:
    if parser is None:
        return ParsedDelta(content=text)
    d = parser.feed(text)
    d.extend(parser.finish())
    return d


def _logprobs(body: ChatCompletionRequest, pieces: Pieces, out: GenerateOutput | None) -> dict | None:
    """``choices[].logprobs`` (OpenAI: {"content": [...]}) of the output tokens in ``out``; None unless asked."""
    if not body.logprobs or out is None:
        return None
    return {"content": chat_logprob_content(pieces, out.logprobs)}


async def _events(request: Request, engine: EngineAPI, reqs: list[GenerateRequest], body: ChatCompletionRequest,
                  response_id: str, parsers: list[OutputParser | None]) -> AsyncIterator[bytes]:
    """OpenAI's order: per choice a role chunk, content deltas, a finish chunk; then usage (if asked), [DONE]."""
    created = int(time.time())
    name = model_name(engine)
    exclude = None if body.include_usage else {"usage"}

    def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        c = ChatCompletionChunk(id=response_id, created=created, model=name,
                                choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                                         logprobs=logprobs)])
        return sse_data(c.model_dump(exclude=exclude))

    pieces = Pieces(engine.tokenizer)
    for i in range(len(reqs)):
        yield chunk(i, ChatDelta(role="assistant", content=""))
    finals: list[GenerateOutput | None] = [None] * len(reqs)
    # aclosing: a client that goes away mid-stream aborts the unfinished requests at once
    async with aclosing(stream_choices(request, engine, reqs, finals)) as choices:
        async for i, out in choices:
            lp = _logprobs(body, pieces, out)
            parser = parsers[i]
            if parser is None:
                d = ParsedDelta(content=out.text)
            else:
                d = parser.feed(out.text)
                if out.finished:
                    d.extend(parser.finish())
            if d or (lp and lp["content"]):
                content = d.content if d.content or not (d.reasoning or d.tool_calls) else None
                yield chunk(i, ChatDelta(content=content, reasoning_content=d.reasoning or None,
                                         tool_calls=delta_tool_calls(d.tool_calls)), logprobs=lp)
            if out.finished:
                yield chunk(i, ChatDelta(), tool_finish_reason(parser, finish_reason_of(out)))
    if any(f is None for f in finals):
        return  # the client is gone
    if body.include_usage:
        usage = make_usage(*summed_usage(finals, body.n))  # type: ignore[arg-type]
        yield sse_data(ChatCompletionChunk(id=response_id, created=created, model=name, choices=[], usage=usage))
    yield DONE
