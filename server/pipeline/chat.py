"""One chat pipeline under three wire formats: OpenAI chat completions (server/api/openai/chat.py), Anthropic Messages
(server/api/anthropic/messages.py) and OpenAI Responses (server/api/responses/routes.py).

Each dialect converts its request into one ``ChatCall`` (a ChatCompletionRequest and what the dialect decides around
it: prompt-caching pins, its own prompt, its max tokens cap), and ``prepare_chat`` does the rest the same way for
all of them: tools and tool_choice, the chat template, max tokens, one engine request (built with the call's pins)
and one output parser (reasoning, then tool calls) per choice, the grammar check. ``run_chat`` collects the parsed
result of every choice; ``stream_chat`` yields the parsed pieces as they are generated. The routes only write the
result in their own shape.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.requests import Request

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.server.api.openai.protocol import ChatCompletionRequest
from tierlm.server.deps import make_request, sub_rid
from tierlm.server.pipeline.generation import (ChoiceResult, collect_outputs, finish_reason_of, stream_choices,
                                               unless_disconnected)
from tierlm.server.pipeline.parsing.base import OutputParser, ParsedDelta
from tierlm.server.pipeline.parsing.pipeline import ChoiceParser
from tierlm.server.pipeline.parsing.reasoning import needs_special_tokens, prompt_opens_thinking, reasoning_parser_for
from tierlm.server.pipeline.pins import PinPoint, pins_for
from tierlm.server.pipeline.sampling_mapping import chat_max_tokens, openai_sampling_params, reject_unsupported_chat
from tierlm.server.pipeline.structured_output import check_grammars
from tierlm.server.pipeline.tokenization import TemplatePolicy, apply_chat_template, off_loop
from tierlm.server.pipeline.tools import (apply_tool_grammar, keeps_special_tokens, template_messages, template_tools,
                                          tool_finish_reason, tool_plan)

logger = logging.getLogger("tierlm.server")


@dataclass
class ChatCall:
    """One chat call as a dialect's converter hands it to the pipeline."""

    chat: ChatCompletionRequest
    # prompt-caching breakpoints (Anthropic's cache_control): every engine request is built with their pins
    pins: list[PinPoint] = field(default_factory=list)
    # the prompt the dialect built itself (the Responses API splices an earlier turn's exact tokens)
    prompt_ids: list[int] | None = None
    # the dialect's own limit, clamped here to what the context leaves after the prompt (logged; as llama.cpp does
    # for clients such as Claude Code that ask for 32000 whatever the model); None: the chat request's own fields
    max_tokens_cap: int | None = None


@dataclass
class ChatRun:
    """A chat request ready to run: its prompt, one checked engine request and one output parser per choice."""

    body: ChatCompletionRequest
    prompt_ids: list[int]
    reqs: list[GenerateRequest]
    parsers: list[ChoiceParser | None]
    max_new_tokens: int


@dataclass
class ChoiceOutcome:
    """One finished choice: everything its parser read out of the text, and why it ended (OpenAI's names:
    stop, length, tool_calls; the routes map them to their own)."""

    parsed: ParsedDelta
    finish_reason: str
    result: ChoiceResult

    @property
    def final(self) -> GenerateOutput:
        assert self.result.final is not None  # collect_outputs raises before a choice lacks its final output
        return self.result.final


@dataclass
class ChatPiece:
    """A streamed piece of choice ``index``: what its parser read out of ``out``'s text; on the choice's last
    piece (``out.finished``) ``finish_reason`` is set."""

    index: int
    delta: ParsedDelta
    out: GenerateOutput
    finish_reason: str | None = None


async def prepare_chat(engine: EngineAPI, call: ChatCall, response_id: str) -> ChatRun:
    """Everything before generation; a RequestError (400) for anything wrong, before anything is queued."""
    body = call.chat
    reject_unsupported_chat(body)
    plan = tool_plan(engine, body)  # tools, tool_choice (server/pipeline/tools.py)
    ids = call.prompt_ids if call.prompt_ids is not None else await off_loop(chat_prompt_ids, engine, body)
    if call.max_tokens_cap is not None:
        max_new_tokens = clamp_to_context(call.max_tokens_cap, len(ids), engine.context_length)
    else:
        max_new_tokens = chat_max_tokens(body, len(ids), engine.context_length)
    pins = await pins_for(engine, call.pins, ids)  # one pin per breakpoint, where its block ends in this prompt
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
        reqs.append(make_request(engine, sub_rid(response_id, c, body.n), ids, params, body.stream, pins=pins))
    await check_grammars(engine, reqs)  # a grammar that does not compile: 400 before anything is queued
    return ChatRun(body=body, prompt_ids=ids, reqs=reqs, parsers=parsers, max_new_tokens=max_new_tokens)


def clamp_to_context(requested: int, prompt_len: int, context_length: int) -> int:
    """At least 1: a prompt that fills the context still reaches engine.validate and gets its "too long" 400."""
    if context_length <= 0 or prompt_len + requested <= context_length:
        return requested
    clamped = max(1, context_length - prompt_len)
    logger.info("max_tokens %d clamped to %d: the prompt's %d tokens leave that much of the context (%d)",
                requested, clamped, prompt_len, context_length)
    return clamped


def chat_prompt_ids(engine: EngineAPI, body: ChatCompletionRequest) -> list[int]:
    """The prompt of a chat request: its messages, tools and template settings through the chat template (blocking:
    run it with off_loop)."""
    return apply_chat_template(engine.tokenizer, template_messages(body.messages),
                               {**template_kwargs(body), **template_tools(body)}, TemplatePolicy.of(engine.args),
                               body.chat_template, body.continue_final_message)


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


async def run_chat(request: Request, engine: EngineAPI, run: ChatRun) -> list[ChoiceOutcome]:
    """Generate every choice to the end (cancelled, with its engine requests aborted, if the client leaves)."""
    results = await unless_disconnected(request, lambda: collect_outputs(engine, run.reqs))
    outcomes = []
    for parser, r in zip(run.parsers, results):
        parsed = parse_all(parser, r.text)
        outcomes.append(ChoiceOutcome(parsed=parsed, result=r,
                                      finish_reason=tool_finish_reason(parser, finish_reason_of(r.final)) or "stop"))
    return outcomes


async def stream_chat(request: Request, engine: EngineAPI, run: ChatRun,
                      finals: list[GenerateOutput | None]) -> AsyncIterator[ChatPiece]:
    """The parsed pieces of every choice as they are generated; each choice's last output lands in ``finals``
    (incomplete when the client went away: the stream then ends early and the engine requests are aborted)."""
    async with aclosing(stream_choices(request, engine, run.reqs, finals)) as choices:
        async for i, out in choices:
            parser = run.parsers[i]
            if parser is None:
                d = ParsedDelta(content=out.text)
            else:
                d = parser.feed(out.text)
                if out.finished:
                    d.extend(parser.finish())
            reason = tool_finish_reason(parser, finish_reason_of(out)) if out.finished else None
            yield ChatPiece(index=i, delta=d, out=out, finish_reason=reason)
