"""Prompt -> token ids for the HTTP layer: plain text, token-id lists, and chat messages via the chat template
(rendered in server/pipeline/render.py's guarded sandbox; a request's own template only where the operator allows it).

Tokenizing (or templating) a prompt of megabytes takes seconds; handlers run it through ``off_loop`` on a small
thread pool, so the event loop keeps answering /health and streaming other requests meanwhile.
"""
from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2

from tierlm.runtime.errors import RequestError
from tierlm.runtime.server_args import ServerArgs
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.server.api.openai.protocol import ChatMessage
from tierlm.server.pipeline import render as chat_render
from tierlm.server.pipeline.render import TIME_LIMIT_S, RenderLimitError
from tierlm.server.pipeline.render import render as render_template
from tierlm.server.pipeline.text_fields import check_strings, check_text

T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1) + 1, thread_name_prefix="tierlm-tokenize")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the tokenizer thread pool and await its result."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


def encode_text(tokenizer: Tokenizer, text: str, param: str = "prompt") -> list[int]:
    """Tokenize like SGLang/vLLM do for raw prompts: with the tokenizer's special tokens (e.g. BOS)."""
    check_text(text, param)
    return list(tokenizer.encode(text))


def decode_ids(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def normalize_prompts(tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]) -> list[tuple[list[int], str | None]]:
    """Each prompt as (token ids, original text or None for id prompts). An empty prompt list is a 400."""
    if isinstance(prompt, str):
        return [(encode_text(tokenizer, prompt), prompt)]
    if not prompt:
        raise RequestError("prompt must not be empty", 400, param="prompt")
    if isinstance(prompt[0], str):
        return [(encode_text(tokenizer, p, f"prompt[{i}]"), p) for i, p in enumerate(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt[0], int):
        return [(list(prompt), None)]  # type: ignore[arg-type]
    return [(list(p), None) for p in prompt]  # type: ignore[union-attr]


def _message_to_template_dict(i: int, m: ChatMessage) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise RequestError(f"only text content parts are supported; messages[{i}].content[{j}] has type "
                                   f"'{part.type}'", 400, param=f"messages[{i}].content")
            texts.append(part.text)
        d["content"] = "".join(texts)
    elif m.content is None:
        d["content"] = ""
    return d


@dataclass(frozen=True)
class TemplatePolicy:
    """What a request may do to the chat template: by default nothing but fill its variables. The template is the
    operator's (--chat-template or the model's); --trust-request-chat-template lets a request bring its own
    (vLLM's rule). Every render is bounded (server/pipeline/render.py)."""

    allow_request_template: bool = False
    max_chars: int = 2 * 8 * 2**20  # a rendered prompt: twice what the default --max-request-bytes body holds
    time_limit_s: float = TIME_LIMIT_S

    @classmethod
    def of(cls, args: ServerArgs) -> TemplatePolicy:
        return cls(allow_request_template=args.trust_request_chat_template, max_chars=2 * args.max_request_bytes,
                   time_limit_s=chat_render.TIME_LIMIT_S)


def request_template(kwargs: dict[str, Any], top_level: str | None, policy: TemplatePolicy) -> tuple[str, str] | None:
    """A template the request sends (vLLM: ``chat_template``, top level or in ``chat_template_kwargs``): a 400
    unless the operator allowed it; popped from ``kwargs`` so it is never a template variable. (field, text)."""
    sent = [(p, v) for p, v in (("chat_template", top_level),
                                 ("chat_template_kwargs.chat_template", kwargs.pop("chat_template", None)))
            if v is not None]
    if not sent:
        return None
    param, text = sent[0]
    if not policy.allow_request_template:
        raise RequestError(
            f"{param}: a request may not replace the server's chat template; the operator chooses it (--chat-template "
            "or the model's own). Start the server with --trust-request-chat-template to allow request templates",
            400, param=param, code="chat_template_not_allowed")
    if not isinstance(text, str):
        raise RequestError(f"{param} must be a string (a jinja template)", 400, param=param)
    check_text(text, param)
    return param, text  # compiled inside the render's limits (jinja runs constant filters while compiling)


def _alias_reasoning(d: dict[str, Any]) -> dict[str, Any]:
    """As transformers does: a message's reasoning under any of its names is also reasoning_content and thinking
    (gpt-oss templates read thinking)."""
    reasoning = next((d[k] for k in ("reasoning_content", "thinking", "reasoning") if d.get(k) is not None), None)
    return d if reasoning is None else {"thinking": reasoning, **d, "reasoning_content": reasoning}


def apply_chat_template(tokenizer: Tokenizer, messages: list[ChatMessage],
                        template_kwargs: dict[str, Any] | None = None, policy: TemplatePolicy = TemplatePolicy(),
                        top_level_template: str | None = None, continue_final_message: bool = False) -> list[int]:
    """Render messages with the chat template (the operator's, or the request's where the policy allows it) in the
    guarded sandbox, ready for the assistant's reply, and tokenize as transformers does (no special tokens added:
    the template writes them). ``continue_final_message``: the last message is the start of the assistant's reply
    (Anthropic's prefill, vLLM's field), left open so the model continues it."""
    if continue_final_message:
        text = _open_final_message(tokenizer, messages, template_kwargs, policy, top_level_template)
    else:
        text = render_chat_text(tokenizer, messages, template_kwargs, policy, top_level_template)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _open_final_message(tokenizer: Tokenizer, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None,
                        policy: TemplatePolicy, top_level_template: str | None) -> str:
    """The conversation rendered without a generation prompt and cut right after the final message's text (as
    transformers' continue_final_message), so its end-of-turn marker is not there."""
    final = messages[-1] if messages else None
    content = final.content if final is not None else None
    if final is None or final.role != "assistant" or not isinstance(content, str) or not content.strip():
        raise RequestError("continue_final_message needs a conversation that ends with an assistant message with "
                           "text to continue", 400, param="messages", code="nothing_to_continue")
    text = render_chat_text(tokenizer, messages, template_kwargs, policy, top_level_template,
                            add_generation_prompt=False)
    end = text.rfind(content.strip())
    if end < 0:
        raise RequestError("the chat template does not write the final assistant message's text as it is, so it "
                           "cannot be continued", 400, param="messages", code="nothing_to_continue")
    return text[:end + len(content.strip())]


def render_chat_text(tokenizer: Tokenizer, messages: list[ChatMessage],
                     template_kwargs: dict[str, Any] | None = None, policy: TemplatePolicy = TemplatePolicy(),
                     top_level_template: str | None = None, add_generation_prompt: bool = True) -> str:
    """The chat template's text for ``messages`` (apply_chat_template before tokenizing; the Responses API renders
    text to splice an earlier turn's exact tokens into the prompt, server/api/responses/prefix.py)."""
    kwargs = dict(template_kwargs or {})
    sent = request_template(kwargs, top_level_template, policy)
    template_param, template = sent or ("messages", tokenizer.chat_template)
    if not template:
        raise RequestError(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot build a prompt; start the "
            "server with --chat-template (a jinja file, or a built-in name such as chatml), or use /v1/completions "
            "with a plain prompt instead", 400, param="messages", code="no_chat_template")
    conversation = [_alias_reasoning(_message_to_template_dict(i, m)) for i, m in enumerate(messages)]
    check_strings(conversation, "messages")
    variables = {"tools": None, "documents": None, **(tokenizer.special_tokens_map or {}), **kwargs,
                 "messages": conversation, "add_generation_prompt": add_generation_prompt}
    try:
        text = render_template(template, variables, policy.max_chars, policy.time_limit_s)
    except RenderLimitError as e:
        raise RequestError(f"the chat template was stopped: {e}", 400, param="messages",
                           code="chat_template_limit") from None
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"{template_param} is not a valid jinja template: {e.message} (line {e.lineno})", 400,
                           param=template_param) from None
    except Exception as e:  # noqa: BLE001 - jinja raises for conversations the template refuses
        raise RequestError(f"the chat template rejected these messages: {e}", 400, param="messages") from None
    return text
