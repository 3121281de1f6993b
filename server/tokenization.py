"""Prompt -> token ids for the HTTP layer: plain text, token-id lists, and chat messages via the chat template."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierlm.runtime.engine_api import Tokenizer
from tierlm.runtime.errors import RequestError
from tierlm.server.protocol import ChatMessage


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Tokenize like SGLang/vLLM do for raw prompts: with the tokenizer's special tokens (e.g. BOS)."""
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
        return [(encode_text(tokenizer, p), p) for p in prompt]  # type: ignore[arg-type]
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


def apply_chat_template(tokenizer: Tokenizer, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render messages with the model's chat template and tokenize, ready for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot build a prompt; "
            "use /v1/completions with a plain prompt instead", 400, param="messages", code="no_chat_template")
    conversation = [_message_to_template_dict(i, m) for i, m in enumerate(messages)]
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
