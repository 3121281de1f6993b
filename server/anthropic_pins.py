"""Prompt caching: each ``cache_control`` breakpoint (a tool, a system block, a message block; at the top level, the
last block) -> a PinRequest for the prompt tokens up to and including that block, kept for its TTL ("5m" default,
"1h") by the KV tiers (runtime/cache/pins.py).

Where a block ends in the prompt is found by rendering the conversation cut after that block (Anthropic's order:
tools, then system, then messages) and taking the longest common prefix of its ids with the full prompt's: the
template's closing markers for the cut message are not part of the full prompt, so they fall away.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import PinRequest
from tierlm.server.anthropic_convert import chat_messages, chat_tools, thinking_kwargs
from tierlm.server.anthropic_protocol import MAX_CACHE_BREAKPOINTS, CacheControl, CountTokensRequest
from tierlm.server.chat_tools import template_messages
from tierlm.server.tokenization import TemplatePolicy, apply_chat_template, off_loop

logger = logging.getLogger("tierlm.server")


@dataclass
class Breakpoint:
    cut: CountTokensRequest  # the request cut after the block (messages may be empty)
    control: CacheControl


def breakpoints(body: CountTokensRequest) -> list[Breakpoint]:
    found: list[Breakpoint] = []
    tools = body.tools or []
    for i, t in enumerate(tools):
        if t.cache_control is not None:
            found.append(Breakpoint(body.model_copy(update={"tools": tools[:i + 1], "system": None, "messages": []}),
                                    t.cache_control))
    if isinstance(body.system, list):
        for i, b in enumerate(body.system):
            if b.cache_control is not None:
                found.append(Breakpoint(body.model_copy(update={"system": body.system[:i + 1], "messages": []}),
                                        b.cache_control))
    for m, msg in enumerate(body.messages):
        if isinstance(msg.content, str):
            continue
        for j, b in enumerate(msg.content):
            control = getattr(b, "cache_control", None)
            if control is not None:
                cut = msg.model_copy(update={"content": msg.content[:j + 1]})
                found.append(Breakpoint(body.model_copy(update={"messages": [*body.messages[:m], cut]}), control))
    if body.cache_control is not None:  # the whole conversation, as if on its last block
        found.append(Breakpoint(body, body.cache_control))
    if len(found) > MAX_CACHE_BREAKPOINTS:
        raise RequestError(f"a request may have at most {MAX_CACHE_BREAKPOINTS} blocks with cache_control; this one "
                           f"has {len(found)}", 400, param="cache_control")
    return found


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _render(engine: EngineAPI, cut: CountTokensRequest, fold_system: bool) -> list[int]:
    tools = chat_tools(cut)
    kwargs = {**thinking_kwargs(cut), **({"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {})}
    return apply_chat_template(engine.tokenizer, template_messages(chat_messages(cut, fold_system)), kwargs,
                               TemplatePolicy.of(engine.args))


async def pins_for(engine: EngineAPI, body: CountTokensRequest, prompt_ids: list[int],
                   fold_system: bool = False) -> list[PinRequest]:
    """One pin per breakpoint (empty without cache_control), the conversation rendered as the prompt was
    (``fold_system``). A cut the template refuses to render (some refuse a conversation without a user turn) pins
    nothing for that breakpoint."""
    pins: list[PinRequest] = []
    for bp in breakpoints(body):
        try:
            ids = await off_loop(_render, engine, bp.cut, fold_system)
        except RequestError as e:
            logger.info("cache_control breakpoint not pinned: the template cannot render the prompt up to it (%s)",
                        e.message)
            continue
        tokens = _common_prefix(ids, prompt_ids)
        if tokens > 0:
            pins.append(PinRequest(tokens=tokens, ttl_s=bp.control.ttl_s))
    return pins
