"""The prompt of a Responses turn that continues an earlier one: the earlier turn's exact tokens, then the rendering
of only what is new, so the whole earlier turn is a prefix-cache hit in whichever tier holds it.

Re-rendering the conversation does not give the earlier tokens back: the template may render the assistant's
message differently from what the model generated (Qwen3 drops the thinking of earlier turns, a tool call's JSON is
re-serialized, a sampled token sequence is not how the tokenizer would split the same text). So a turn keeps its
prompt + output ids (server/api/responses/reasoning_blob.TurnTokens: in the store for previous_response_id, in
encrypted_content for store: false) and the next prompt is

    earlier ids + tokens(the template's text after the earlier assistant message, up to the new generation prompt)

where that text is found by rendering the conversation with the earlier assistant message replaced by a sentinel
and taking what follows it (the template's turn close, the new messages, the generation prompt). The earlier ids are
used only while the conversation before that assistant message still renders to the very prompt they came from
(its sha256 is kept with them) and the assistant message itself is the output the ids hold (its text and tool calls:
a client that edits them, or adds a message that joins that turn, gets them rendered whole, as chat completions
does; ``assistant_digest``).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from tierlm.runtime.errors import RequestError
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.server.api.openai.protocol import ChatMessage
from tierlm.server.api.responses.reasoning_blob import TurnTokens
from tierlm.server.pipeline.tokenization import TemplatePolicy, render_chat_text
from tierlm.server.pipeline.tools import template_messages

logger = logging.getLogger("tierlm.server")
_SENTINEL = "\ue000tierlm-turn\ue001"  # private-use characters: no conversation contains them by chance


@dataclass
class Earlier:
    """An earlier turn to continue: its tokens, and the index of its assistant message in the new messages."""

    turn: TurnTokens
    first_assistant: int


@dataclass
class Prompt:
    ids: list[int]
    prompt_hash: str  # sha256 of the text this turn's prompt stands for
    spliced: int = 0  # tokens reused verbatim from the earlier turn


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def build_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], kwargs: dict[str, Any], policy: TemplatePolicy,
                 earlier: Earlier | None) -> Prompt:
    """The prompt ids for ``messages`` (run off the event loop: it renders the template up to three times)."""
    msgs = template_messages(messages)
    full = render_chat_text(tokenizer, msgs, kwargs, policy)
    if earlier is not None:
        spliced = _splice(tokenizer, msgs, kwargs, policy, earlier)
        if spliced is not None:
            return Prompt(ids=spliced, prompt_hash=text_hash(full), spliced=len(earlier.turn.ids))
    return Prompt(ids=encode(tokenizer, full), prompt_hash=text_hash(full))


def assistant_digest(message: ChatMessage) -> str:
    """What of an assistant message the model's output ids stand for: its text and its calls (name, arguments).
    Call ids and reasoning are left out: the server assigns the ids, and clients may drop reasoning text (the ids
    hold it)."""
    calls = [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
             for c in message.tool_calls or []]
    return text_hash(json.dumps({"content": message.content or "", "calls": calls}, sort_keys=True, default=str))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _splice(tokenizer: Tokenizer, msgs: list[ChatMessage], kwargs: dict[str, Any], policy: TemplatePolicy,
            earlier: Earlier) -> list[int] | None:
    k = earlier.first_assistant
    if not 0 < k < len(msgs) - 1 or msgs[k].role != "assistant":
        return None  # nothing new after the earlier turn, or it is not where it should be
    if not earlier.turn.output_digest or assistant_digest(msgs[k]) != earlier.turn.output_digest:
        logger.info("/v1/responses: the earlier assistant turn is not the output its tokens hold (edited, or joined "
                    "by another message); rendering the conversation whole")
        return None
    before = render_chat_text(tokenizer, msgs[:k], kwargs, policy)
    if text_hash(before) != earlier.turn.prompt_hash:
        logger.info("/v1/responses: the conversation before the earlier turn renders differently now (instructions, "
                    "tools or messages changed); rendering it whole")
        return None
    stub = ChatMessage(role="assistant", content=_SENTINEL)
    try:
        text = render_chat_text(tokenizer, [*msgs[:k], stub, *msgs[k + 1:]], kwargs, policy)
    except RequestError:
        return None  # the template wants the real message there (e.g. tool calls before tool results)
    if text.count(_SENTINEL) != 1:
        return None
    return earlier.turn.ids + encode(tokenizer, text.split(_SENTINEL, 1)[1])
