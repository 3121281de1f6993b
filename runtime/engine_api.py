"""The runtime's doors to the HTTP layer: EngineAPI (what the server needs from an engine; ``Engine`` and the
tests' FakeEngine implement it) and Tokenizer (what tierlm uses of a transformers tokenizer)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Sequence, runtime_checkable

from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.server_args import ServerArgs


class Tokenizer(Protocol):
    """The part of a transformers tokenizer tierlm uses (optional attributes such as eos_token_id are read
    with getattr)."""

    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """Token ids (a list, or a mapping with input_ids in transformers >= 5) when tokenize=True."""


@runtime_checkable
class EngineAPI(Protocol):
    args: ServerArgs
    ready: bool  # False while the model loads (the server answers 503)
    tokenizer: Tokenizer  # once ready
    context_length: int

    def validate(self, req: GenerateRequest) -> None:
        """Raise RequestError (400) for a request the engine cannot serve."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Output increments until one with finished=True; closing the iterator early aborts the request."""

    def abort(self, rid: str) -> None: ...

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Raise RequestError (400, param naming the field) when the request's grammar (json_schema, regex,
        ebnf) does not compile or structured output is off; a no-op for an unconstrained request."""

    async def flush_cache(self, storage: bool = False) -> bool:
        """False when requests are still running (nothing was flushed)."""

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Raise RequestError (400, param ``param``) for an id outside the model's vocabulary."""

    async def get_load(self) -> dict[str, int]:
        """num_reqs (running + waiting), num_waiting_reqs, num_tokens (KV of running requests + waiting prompts)."""

    def server_info(self) -> dict[str, Any]: ...

    def metrics_text(self) -> bytes: ...

    def shutdown(self) -> None: ...
