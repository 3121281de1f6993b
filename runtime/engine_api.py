"""The runtime's door to the HTTP layer: EngineAPI, what the server needs from an engine (``Engine`` and the
tests' FakeEngine implement it); the tokenizer it hands out is runtime/tokenizer_protocol.Tokenizer."""
from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Sequence, runtime_checkable

from tierlm.runtime.chat_format import ChatFormat
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.server_args import ServerArgs
from tierlm.runtime.tokenizer_protocol import Tokenizer


@runtime_checkable
class EngineAPI(Protocol):
    args: ServerArgs
    ready: bool  # False while the model loads (the server answers 503)
    tokenizer: Tokenizer  # once ready
    chat_format: ChatFormat  # once ready: the chat template and the reasoning / tool-call parsers, decided once
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
