"""Tokenizer: the part of a transformers tokenizer tierlm calls (the engine, the detokenizer, the HTTP layer)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence


class Tokenizer(Protocol):
    """What tierlm uses of the model's tokenizer (backends/model_source/tokenizer.py loads a transformers one;
    the tests' FakeTokenizer implements the same)."""

    chat_template: str | None  # None: the model has none (chat requests need --chat-template)
    eos_token_id: int | None
    all_special_tokens: list[str]  # decoded with skip_special_tokens=False when a parser needs its markers
    special_tokens_map: dict[str, Any]  # bos_token, eos_token, ...: chat template variables (server/pipeline/render.py)

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...
