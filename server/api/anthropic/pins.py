"""Prompt caching: where a request's ``cache_control`` breakpoints are (a tool, a system block, a message block; at
the top level, the last block), each as the request cut after that block (Anthropic's order: tools, then system,
then messages) with its TTL ("5m" default, "1h"). Found once per request; more than Anthropic's four is a 400.

The converter (server/api/anthropic/convert.py, ``to_chat_call``) turns each cut into a pin point of the call, and
the pipeline builds the engine requests with their pins (server/pipeline/pins.py): the prompt tokens up to and
including each block, kept for its TTL by the KV tiers (runtime/cache/pins.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from tierlm.runtime.errors import RequestError
from tierlm.server.api.anthropic.protocol import MAX_CACHE_BREAKPOINTS, CacheControl, CountTokensRequest


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
