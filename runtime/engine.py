"""Engine: the runtime's front door. Owns the tokenizer, the backend and the scheduler thread.

The HTTP layer calls ``generate`` (an async iterator of output increments), ``abort``, ``flush_cache``,
``server_info`` and ``metrics_text``. Requests cross into the scheduler thread through a queue; outputs
come back to the event loop with ``call_soon_threadsafe``.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.runtime.server_args import ServerArgs


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ready = False
        self.tokenizer: Any = None
        self.context_length: int = 0

    def start(self) -> None:
        """Load tokenizer and model (with progress bars), size the pools, start the scheduler thread."""
        raise NotImplementedError

    def validate(self, req: GenerateRequest) -> None:
        """Raise RequestError (400) for a prompt the engine cannot serve (too long, empty, bad token ids)."""
        raise NotImplementedError

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield output increments until one with finished=True. Cancelling the iterator aborts the request."""
        raise NotImplementedError
        yield  # pragma: no cover

    def abort(self, rid: str) -> None:
        raise NotImplementedError

    async def flush_cache(self, storage: bool = False) -> bool:
        raise NotImplementedError

    def server_info(self) -> dict[str, Any]:
        raise NotImplementedError

    def metrics_text(self) -> bytes:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError
