"""Anthropic Messages API request schemas (POST /v1/messages, /v1/messages/count_tokens).

As on the OpenAI routes, fields tierlm does not use are accepted and ignored (extra="allow"; docs/api.md lists
them: Claude Code sends context_management, output_config, metadata, defer_loading on tools). Content blocks that
carry meaning tierlm cannot honour (images, documents, ...) are a 400 that names the block type.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool, Tag

from tierlm.server.pipeline.request_fields import INT32_MAX
from tierlm.server.pipeline.text_fields import CheckedText

MAX_CACHE_BREAKPOINTS = 4  # as Anthropic: at most four blocks with cache_control per request

_Open = ConfigDict(extra="allow")
KNOWN_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class CacheControl(BaseModel):
    model_config = _Open
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None

    @property
    def ttl_s(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


def _block_type(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


def _only(known: tuple[str, ...]) -> Any:
    """Checked before the union, so the 400 says in one sentence which block type is not supported."""
    def check(content: Any) -> Any:
        for i, block in enumerate(content if isinstance(content, list) else []):
            kind = _block_type(block)
            if kind not in known:
                raise ValueError(f"content block {i} has type '{kind}', which this server does not support (it "
                                 f"serves text-only models); supported here: {', '.join(known)}")
        return content
    return BeforeValidator(check)


class TextBlock(BaseModel):
    model_config = _Open
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    model_config = _Open
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = _Open
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock] | None, _only(("text",))] = None  # an image a tool read: 400
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class ThinkingBlock(BaseModel):
    model_config = _Open
    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = _Open
    type: Literal["redacted_thinking"]
    data: str = ""






ContentBlock = Annotated[Union[
    Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
    Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
    Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
], Discriminator(_block_type)]


class Message(BaseModel):
    model_config = _Open
    # "system" inside messages: Claude Code sends one (beta mid-conversation-system); it stays where it is
    role: Literal["user", "assistant", "system"]
    content: Annotated[str | list[ContentBlock], _only(KNOWN_BLOCKS)]


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (a ``type`` such as web_search_20250305, no input_schema) are
    left out of what the model sees (tierlm cannot run them)."""

    model_config = _Open
    name: str = Field(min_length=1)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None

    @property
    def is_client_tool(self) -> bool:
        return self.type in (None, "custom") and self.input_schema is not None


class ToolChoice(BaseModel):
    model_config = _Open
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(BaseModel):
    model_config = _Open
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)  # accepted; the thinking is not cut at the budget
    display: str | None = None  # "omitted": thinking blocks come back without their text

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class CountTokensRequest(CheckedText):
    model_config = _Open
    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # top level: a breakpoint after the last block (automatic caching)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None  # accepted, unused
