"""The in-memory store behind ``store: true``, ``previous_response_id`` and GET/DELETE /v1/responses/{id}.

Bounded by count and by bytes (least recently used out first, a read counts as a use); nothing is written to disk,
so a restart forgets every response. Each entry keeps what a follow-up needs to rebuild the conversation and splice
the earlier turn's exact tokens into its prompt (server/api/responses/prefix.py)."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tierlm.server.api.responses.reasoning_blob import TurnTokens

MAX_RESPONSES = 1024
MAX_BYTES = 256 * 2**20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    items: list[dict[str, Any]]  # the conversation: every earlier input and output item, then this turn's output
    instructions: str | None
    turn: TurnTokens  # this turn's tokens
    output_start: int  # items[output_start:] are this turn's output
    size: int = 0


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        # what it costs in memory, roughly: the JSON of what it holds, 8 bytes per token id
        entry.size = (len(json.dumps(entry.response)) + len(json.dumps(entry.items)) + 8 * len(entry.turn.ids)
                      + len(entry.instructions or ""))
        rid = entry.response["id"]
        self.delete(rid)
        if entry.size > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a follow-up gets the 404 that says so)
        self._entries[rid] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        old = self._entries.pop(rid, None)
        if old is None:
            return False
        self.bytes -= old.size
        return True
