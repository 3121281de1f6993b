"""An Anthropic Messages request -> the ChatCall the chat pipeline runs (server/pipeline/chat.py): its chat request,
its cache_control breakpoints (server/api/anthropic/pins.py) as pin points, and max_tokens as the cap.

- ``system`` (string or text blocks, joined by a blank line) is the first system message; a ``role: "system"``
  message inside ``messages`` stays where it is, or, for templates that refuse a system message after the first
  (``fold_system``), its text joins a user message where appended turns leave earlier tokens alone (``_folded``).
- Claude Code's first system block, ``x-anthropic-billing-header: ...`` (a hash that changes with every prompt),
  is left out unless --keep-anthropic-billing-header: kept, no two sessions would share their cached prefix.
- A user message's ``tool_result`` blocks become ``tool`` messages (an ``is_error`` result is prefixed "Error: "),
  its text blocks one user message after them; an assistant message's ``tool_use`` blocks become ``tool_calls``
  and its ``thinking`` blocks ``reasoning_content`` (templates that show past thinking read it).
- tools -> function tools (server tools such as web_search are left out: tierlm cannot run them); tool_choice
  auto/any/tool/none -> auto/required/named/none, disable_parallel_tool_use -> parallel_tool_calls false;
  stop_sequences -> stop; thinking -> the template's enable_thinking, and the reasoning parser separates it.
- A final assistant message with text is a prefill: the reply continues it (continue_final_message).
- Each breakpoint's cut is rendered as the full prompt is (the same fold, the tools and thinking setting it has,
  no prefill), so the pipeline finds where its block ends in the prompt.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from tierlm.runtime.errors import RequestError
from tierlm.server.api.anthropic.pins import Breakpoint
from tierlm.server.api.anthropic.protocol import (CountTokensRequest, Message, MessagesRequest, TextBlock,
                                                  ThinkingBlock, ToolResultBlock, ToolUseBlock)
from tierlm.server.api.openai.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from tierlm.server.pipeline.chat import ChatCall
from tierlm.server.pipeline.pins import PinPoint
from tierlm.server.pipeline.tools import template_messages

logger = logging.getLogger("tierlm.server")
SYSTEM_JOIN = "\n\n"


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return SYSTEM_JOIN.join(b.text for b in system) or None


def chat_messages(body: CountTokensRequest, fold_system: bool = False) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    system = system_text(body.system)
    if system is not None:
        out.append(ChatMessage(role="system", content=system))
    for m in body.messages:
        out.extend(_convert(m))
    return _folded(out) if fold_system else out


def refused_late_system(e: RequestError, body: CountTokensRequest) -> bool:
    """Whether the chat template's refusal ``e`` may be of a system message after the first (``body`` has one:
    Claude Code sends it), which rendering again with ``fold_system`` answers."""
    return e.param == "messages" and any(m.role == "system" for m in chat_messages(body)[1:])


def _folded(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Each system message after the first joins a user message, where the turns before it keep their tokens when
    turns are appended: the user message it follows when no assistant turn lies between (Claude Code sends its agent
    list right after the first prompt, and every later request keeps it there), else the next user message (a
    reminder sent with a new prompt); the previous user message when none follows; the leading system message when
    no user message exists yet."""
    out: list[ChatMessage] = []
    held: list[str] = []  # late system text waiting for the next user message
    for i, m in enumerate(messages):
        if m.role == "system" and i > 0:
            text = str(m.content or "")
            j = _previous_user(out)
            if j is not None and all(o.role != "assistant" for o in out[j + 1:]):
                out[j] = _joined(out[j], text)
            else:
                held.append(text)
        elif m.role == "user" and held:
            out.append(m.model_copy(update={"content": SYSTEM_JOIN.join([*held, str(m.content or "")])}))
            held = []
        else:
            out.append(m)
    if held:
        j = _previous_user(out)
        if j is not None:
            out[j] = _joined(out[j], *held)
        elif out and out[0].role == "system":
            out[0] = _joined(out[0], *held)
        else:
            out.append(ChatMessage(role="user", content=SYSTEM_JOIN.join(held)))
    return out


def _previous_user(messages: list[ChatMessage]) -> int | None:
    return max((j for j, o in enumerate(messages) if o.role == "user"), default=None)


def _joined(m: ChatMessage, *texts: str) -> ChatMessage:
    return m.model_copy(update={"content": SYSTEM_JOIN.join([str(m.content or ""), *texts])})


def _convert(m: Message) -> list[ChatMessage]:
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    texts = [b.text for b in m.content if isinstance(b, TextBlock)]
    if m.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in m.content if isinstance(b, ToolUseBlock)]
        thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
        extra: dict[str, Any] = {"reasoning_content": thinking} if thinking else {}
        return [ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None, **extra)]
    out = [ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=("Error: " if b.is_error else "") + b.text())
           for b in m.content if isinstance(b, ToolResultBlock)]
    if texts or not out:
        out.append(ChatMessage(role=m.role, content="".join(texts)))
    return out


def chat_tools(body: CountTokensRequest) -> list[ToolDefinition] | None:
    if not body.tools:
        return None
    tools = [ToolDefinition.model_validate({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.input_schema}})
        for t in body.tools if t.is_client_tool]
    left_out = [t.name for t in body.tools if not t.is_client_tool]
    if left_out:
        logger.info("anthropic messages: server tools %s left out of what the model sees (tierlm cannot run them)",
                    ", ".join(left_out))
    return tools or None


def _tool_choice(body: CountTokensRequest, tools: list[ToolDefinition] | None) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    choice = body.tool_choice
    if choice is None or not tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise RequestError(f"tool_choice '{choice.type}' needs tools", 400, param="tool_choice")
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice of type 'tool' needs the tool's name", 400, param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"any": "required"}.get(choice.type, choice.type), parallel


def thinking_kwargs(body: CountTokensRequest) -> dict[str, Any]:
    """The template's enable_thinking: on for thinking enabled/adaptive, off otherwise (Anthropic's default)."""
    return {"enable_thinking": bool(body.thinking and body.thinking.on)}


def to_chat_request(body: CountTokensRequest, stream: bool = False,
                    fold_system: bool = False) -> ChatCompletionRequest:
    """The chat request for ``body``; its max tokens are the route's business (clamped to the context)."""
    tools = chat_tools(body)
    tool_choice, parallel = _tool_choice(body, tools)
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        fields = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                  "stop": body.stop_sequences or None}
    messages = chat_messages(body, fold_system)
    return ChatCompletionRequest(model=body.model, messages=messages, tools=tools,
                                 tool_choice=tool_choice, parallel_tool_calls=parallel,
                                 chat_template_kwargs=thinking_kwargs(body), stream=stream,
                                 continue_final_message=is_prefill(messages), **fields)


def is_prefill(messages: list[ChatMessage]) -> bool:
    """Anthropic: a conversation that ends with an assistant message's text has the reply start with that text
    (the model continues it; the response holds only the continuation)."""
    last = messages[-1] if messages else None
    return last is not None and last.role == "assistant" and not last.tool_calls and bool(
        isinstance(last.content, str) and last.content.strip())


def to_chat_call(body: MessagesRequest, points: list[Breakpoint], fold_system: bool = False) -> ChatCall:
    """The call for ``body``: its chat request, a pin point per breakpoint (``points``: breakpoints(body), found
    once), and max_tokens as the cap the pipeline clamps to what the context leaves after the prompt."""
    return ChatCall(chat=to_chat_request(body, stream=body.stream, fold_system=fold_system),
                    pins=[pin_point(bp, fold_system) for bp in points], max_tokens_cap=body.max_tokens)


def pin_point(bp: Breakpoint, fold_system: bool) -> PinPoint:
    """The conversation cut after a breakpoint's block, as the chat template reads it."""
    tools = chat_tools(bp.cut)
    kwargs = {**thinking_kwargs(bp.cut),
              **({"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {})}
    return PinPoint(messages=template_messages(chat_messages(bp.cut, fold_system)), template_kwargs=kwargs,
                    ttl_s=bp.control.ttl_s)
