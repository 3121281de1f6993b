"""A Responses API request -> the chat pipeline's ChatCompletionRequest (server/pipeline/chat.py).

- ``input`` items become chat messages: ``message`` (text parts joined), ``function_call`` (an assistant message's
  ``tool_calls``), ``function_call_output`` (a ``tool`` message), ``reasoning`` (the ``reasoning_content`` of the
  assistant message it precedes). Consecutive assistant-side items (reasoning, an assistant message, function calls)
  are one assistant turn, as one generation produces them, so an earlier response's output renders as it was made.
- ``tools``: function tools as they are; ``namespace`` groups flattened to ``<namespace>__<name>`` (the name the
  model sees and calls; calls are mapped back to ``namespace`` + ``name``); hosted tools (web_search, file_search, ...)
  are left out, logged once per tool type; anything else is a 400.
- ``instructions`` -> a system message first; ``text.format`` -> response_format; ``reasoning.effort`` ->
  reasoning_effort; ``max_output_tokens`` -> max_completion_tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tierlm.runtime.errors import RequestError
from tierlm.server.api.openai.protocol import ChatCompletionRequest, ChatMessage
from tierlm.server.api.responses.protocol import HOSTED_TOOL_TYPES, ResponsesRequest

logger = logging.getLogger("tierlm.server")

# Tools OpenAI runs on its own servers: tierlm cannot run them, so the model does not see them (docs/api.md)
HOSTED_TOOLS = frozenset(HOSTED_TOOL_TYPES)
NAMESPACE_SEP = "__"
_EFFORT = {"none": None, "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
_logged_hosted: set[str] = set()


@dataclass
class Conversation:
    """The chat messages of a Responses conversation, and where each assistant turn that carried a reasoning blob
    starts (message index -> the blob, with the item path for a 400)."""

    messages: list[ChatMessage] = field(default_factory=list)
    blobs: list[tuple[int, str, str]] = field(default_factory=list)  # (message index, blob, param)


@dataclass
class ToolNames:
    """Flat names the model calls -> (namespace, name) for the function_call items."""

    by_flat: dict[str, tuple[str | None, str]] = field(default_factory=dict)

    def split(self, flat: str) -> tuple[str | None, str]:
        return self.by_flat.get(flat, (None, flat))

    @staticmethod
    def flat(namespace: str | None, name: str) -> str:
        return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def _text_of(content: Any, param: str) -> str:
    """A message's content: a string, or parts of text (images, files and audio are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{param} must be a string or a list of content parts", 400, param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise RequestError(f"{param}[{j}] has type '{kind}'; tierlm reads text parts only (input_text, "
                               "output_text)", 400, param=f"{param}[{j}].type", code="unsupported_content")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{param}[{j}].text must be a string", 400, param=f"{param}[{j}].text")
        texts.append(text)
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{param}.{key} must be a string", 400, param=f"{param}.{key}")
    return value


class _Builder:
    def __init__(self) -> None:
        self.conv = Conversation()
        self.turn: ChatMessage | None = None  # the assistant turn being assembled

    def assistant(self) -> ChatMessage:
        if self.turn is None:
            self.turn = ChatMessage(role="assistant", content=None)
            self.conv.messages.append(self.turn)
        return self.turn

    def add(self, m: ChatMessage) -> None:
        self.turn = None
        self.conv.messages.append(m)


def conversation(instructions: str | None, items: list[dict[str, Any]], params: list[str]) -> Conversation:
    """The chat messages of ``items`` (``params``: each item's path, for the 400s)."""
    b = _Builder()
    if instructions:
        b.add(ChatMessage(role="system", content=instructions))
    for item, param in zip(items, params):
        if not isinstance(item, dict):
            raise RequestError(f"{param} must be an object", 400, param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _text_of(item.get("content"), f"{param}.content")
            if role == "assistant":
                turn = b.assistant()
                if turn.tool_calls:  # text after calls: a new turn
                    b.turn = None
                    turn = b.assistant()
                turn.content = (turn.content or "") + text
            elif role in ("user", "system", "developer"):
                b.add(ChatMessage(role=role, content=text))
            else:
                raise RequestError(f"{param}.role must be user, system, developer or assistant", 400,
                                   param=f"{param}.role")
        elif kind == "reasoning":
            text = _text_of(item.get("content"), f"{param}.content") or _text_of(item.get("summary"),
                                                                                  f"{param}.summary")
            if text and b.turn is not None and (b.turn.content or b.turn.tool_calls):
                b.turn = None  # reasoning text opens the next generation
            turn = b.assistant()  # a reasoning item with only a blob belongs to the turn it follows (tierlm puts
            if text:              # it last: the blob holds the turn's output tokens, known only at its end)
                previous = getattr(turn, "reasoning_content", None) or ""
                setattr(turn, "reasoning_content", previous + text)
            blob = item.get("encrypted_content")
            if isinstance(blob, str) and blob:
                b.conv.blobs.append((len(b.conv.messages) - 1, blob, f"{param}.encrypted_content"))
        elif kind == "function_call":
            name = ToolNames.flat(item.get("namespace"), _string(item, "name", param))
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": name, "arguments": _string(item, "arguments", param)}}
            turn = b.assistant()
            turn.tool_calls = [*(turn.tool_calls or []), call]
        elif kind == "function_call_output":
            b.add(ChatMessage(role="tool", tool_call_id=_string(item, "call_id", param),
                              content=_text_of(item.get("output"), f"{param}.output")))
        elif kind == "web_search_call":
            continue  # a hosted tool's record: nothing the model saw
        else:
            raise RequestError(f"{param} has type '{kind}'; tierlm reads message, function_call, "
                               "function_call_output and reasoning items", 400, param=f"{param}.type",
                               code="unsupported_item")
    return b.conv


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], ToolNames]:
    """The request's tools as chat tools (namespaces flattened, hosted ones left out)."""
    out: list[dict[str, Any]] = []
    names = ToolNames()

    def function(t: dict[str, Any], param: str, namespace: str | None = None) -> None:
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{param}.name must be a non-empty string", 400, param=f"{param}.name")
        flat = ToolNames.flat(namespace, name)
        names.by_flat[flat] = (namespace, name)
        fn = {"name": flat, "description": t.get("description"), "parameters": t.get("parameters"),
              "strict": t.get("strict")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})

    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            function(t, f"tools[{i}]")
        elif kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not ns:
                raise RequestError(f"tools[{i}].name must be a non-empty string", 400, param=f"tools[{i}].name")
            for j, inner in enumerate(t.get("tools") or []):
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise RequestError(f"tools[{i}].tools[{j}]: a namespace holds function tools here", 400,
                                       param=f"tools[{i}].tools[{j}].type", code="unsupported_tool")
                function(inner, f"tools[{i}].tools[{j}]", ns)
        elif kind in HOSTED_TOOLS:
            if kind not in _logged_hosted:
                _logged_hosted.add(kind)
                logger.info("/v1/responses: the hosted tool '%s' runs on OpenAI's servers, not here; it is left out "
                            "of what the model sees", kind)
        else:
            raise RequestError(f"tools[{i}] has type '{kind}'; tierlm serves function and namespace tools (hosted "
                               "tools such as web_search are left out)", 400, param=f"tools[{i}].type",
                               code="unsupported_tool")
    return out, names


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> Any:
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in ("none", "auto", "required"):
            raise RequestError("tool_choice must be none, auto, required or {type: function, name}", 400,
                               param="tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice 'required' needs a function tool; the only tools given are hosted ones, "
                               "which tierlm leaves out (it cannot run them)", 400, param="tool_choice")
        return choice if tools else None  # only hosted tools left: nothing to choose
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError("tool_choice: only none, auto, required and {type: function, name} are supported", 400,
                           param="tool_choice")
    return {"type": "function", "function": {"name": ToolNames.flat(choice.get("namespace"), choice["name"])}}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise RequestError("text.format.type must be text, json_object or json_schema", 400, param="text.format.type")


def chat_request(body: ResponsesRequest, messages: list[ChatMessage], tools: list[dict[str, Any]]) -> \
        ChatCompletionRequest:
    """The chat pipeline's request for ``messages`` with the Responses request's settings."""
    if not messages:
        raise RequestError("input must hold at least one message", 400, param="input")
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": tools or None,
        "tool_choice": _tool_choice(body.tool_choice, tools), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
        "reasoning_effort": _EFFORT[body.reasoning.effort] if body.reasoning and body.reasoning.effort else None,
    }
    if body.reasoning is not None and body.reasoning.effort == "none":
        # no reasoning asked for: hybrid thinking templates (Qwen3's) read enable_thinking, as on /v1/messages
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        param = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}.get(
            where.split(".")[0], where.split(".")[0])
        raise RequestError(f"{param}: {first.get('msg')} ({where})", 400, param=param) from None
