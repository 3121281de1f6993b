"""A replayed request for a peer that lacks the client's own endpoint (no /v1/messages, or no /v1/responses): the
same conversation as a streamed /v1/chat/completions request, as a translating proxy would send it.

The conversion is tierlm's own (server/api/anthropic/convert.py, server/api/responses/input.py), so tools become
function tools, content blocks and items become chat messages exactly as tierlm itself reads them; unlike tierlm's
route, the billing header stays (a proxy passes the client's system blocks on). Only the fields every
OpenAI-compatible server reads are sent (no chat_template_kwargs, no reasoning_content)."""
from __future__ import annotations

from typing import Any

from tierlm.server.commands.bench.agent.plan import PlannedRequest

CHAT_PATH = "/v1/chat/completions"
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def chat_request_of(req: PlannedRequest) -> Any:
    """tierlm's ChatCompletionRequest for the replayed body."""
    if req.path.endswith("/responses"):
        from tierlm.server.api.responses.input import chat_request, chat_tools, conversation, input_items
        from tierlm.server.api.responses.protocol import ResponsesRequest

        body = ResponsesRequest.model_validate(req.body)
        items = input_items(body)
        conv = conversation(body.instructions, items, [f"input[{j}]" for j in range(len(items))])
        tools, _ = chat_tools(body.tools)
        return chat_request(body, conv.messages, tools)
    from tierlm.server.api.anthropic.convert import to_chat_request
    from tierlm.server.api.anthropic.protocol import MessagesRequest

    return to_chat_request(MessagesRequest.model_validate(req.body))


def to_chat_completions(req: PlannedRequest, model: str, max_tokens: int) -> dict[str, Any]:
    """The streamed chat completions body for ``req`` (greedy, ``max_tokens``, usage in the last chunk)."""
    chat = chat_request_of(req).model_dump(exclude_none=True)
    messages = []
    for m in chat["messages"]:
        m = {k: m[k] for k in MESSAGE_KEYS if k in m}
        if m["role"] == "developer":  # not every server knows OpenAI's newer name for it
            m["role"] = "system"
        messages.append(m)
    out: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}
    for key in ("tools", "tool_choice", "parallel_tool_calls"):
        if chat.get(key) is not None:
            out[key] = chat[key]
    return out
