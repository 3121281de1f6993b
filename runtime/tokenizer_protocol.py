"""Tokenizer: the part of a transformers tokenizer tierlm calls (the engine, the detokenizer, the HTTP layer)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence


class Tokenizer(Protocol):
    """What tierlm uses of the model's tokenizer (backends/model_source/tokenizer.py loads a transformers one;
    the tests' FakeTokenizer implements the same)."""

    chat_template: str | None  # None: the model has none (chat requests need --chat-template)
    eos_token_id: int | None
    all_special_tokens: list[str]  # decoded with skip_special_tokens=False when a parser needs its markers

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """Token ids (a list, or a mapping with input_ids in transformers >= 5) when tokenize=True."""

    def get_vocab(self) -> dict[str, int]: ...
