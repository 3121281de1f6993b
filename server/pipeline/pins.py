"""Prompt caching in the pipeline: a call's pin points -> the PinRequests its engine requests are built with, each
keeping the prompt tokens up to a breakpoint for its TTL in the KV tiers (runtime/cache/pins.py).

A dialect says where its breakpoints are (Anthropic's ``cache_control`` blocks, server/api/anthropic/pins.py) as
``PinPoint``s: the conversation cut after the block, as the chat template reads it. Where that block ends in the
prompt is found by rendering the cut and taking the longest common prefix of its ids with the full prompt's: the
template's closing markers for the cut message are not part of the full prompt, so they fall away.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierlm.runtime.engine_api import EngineAPI
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import PinRequest
from tierlm.server.api.openai.protocol import ChatMessage
from tierlm.server.pipeline.tokenization import TemplatePolicy, apply_chat_template, off_loop

logger = logging.getLogger("tierlm.server")


@dataclass(frozen=True)
class PinPoint:
    """A prompt-caching breakpoint: the conversation cut after its block (template messages and keywords, as the
    full prompt was rendered), and how long the prompt up to there stays pinned."""

    messages: list[ChatMessage]
    template_kwargs: dict[str, Any]  # the chat template's keywords (apply_chat_template's own type)
    ttl_s: float


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _render(engine: EngineAPI, point: PinPoint) -> list[int]:
    return apply_chat_template(engine.tokenizer, point.messages, point.template_kwargs, TemplatePolicy.of(engine.args))


async def pins_for(engine: EngineAPI, points: Sequence[PinPoint], prompt_ids: list[int]) -> list[PinRequest]:
    """One pin per point (none without points). A cut the template refuses to render (some refuse a conversation
    without a user turn) pins nothing for that point."""
    pins: list[PinRequest] = []
    for point in points:
        try:
            ids = await off_loop(_render, engine, point)
        except RequestError as e:
            logger.info("cache_control breakpoint not pinned: the template cannot render the prompt up to it (%s)",
                        e.message)
            continue
        tokens = _common_prefix(ids, prompt_ids)
        if tokens > 0:
            pins.append(PinRequest(tokens=tokens, ttl_s=point.ttl_s))
    return pins
