"""Prompt -> token ids for the HTTP layer: plain text, token-id lists, and chat messages via the chat template.

Tokenizing (or templating) a prompt of megabytes takes seconds; handlers run it through ``off_loop`` on a small
thread pool, so the event loop keeps answering /health and streaming other requests meanwhile.
"""
from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tierlm.runtime.errors import RequestError
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.server.protocol import ChatMessage

T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1) + 1, thread_name_prefix="tierlm-tokenize")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the tokenizer thread pool and await its result."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


def check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which no tokenizer
    can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"{param} contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character {e.start}), which "
            "is not valid Unicode; send the text as UTF-8, with surrogates only in valid pairs", 400,
            param=param, code="invalid_unicode") from None


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


def _check_strings(value: Any, param: str) -> None:
    """check_text on every string inside a JSON-like value, naming the field that fails."""
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_strings(v, f"{param}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{param}[{i}]")


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


def apply_chat_template(tokenizer: Tokenizer, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render messages with the model's chat template and tokenize, ready for the assistant's reply."""
    if not tokenizer.chat_template:
        raise RequestError(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot build a prompt; start the "
            "server with --chat-template (a jinja file, or a built-in name such as chatml), or use /v1/completions "
            "with a plain prompt instead", 400, param="messages", code="no_chat_template")
    conversation = [_message_to_template_dict(i, m) for i, m in enumerate(messages)]
    _check_strings(conversation, "messages")
    try:
        out = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja raises for conversations the template refuses
        raise RequestError(f"the chat template rejected these messages: {e}", 400, param="messages") from None
    # transformers >= 5 returns a BatchEncoding by default; older versions a plain list.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
