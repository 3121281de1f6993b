"""Fresh per-session ids in the formats the recorded clients use (session UUIDs, tool-use ids, billing-header
suffixes, Codex's time-ordered UUIDs), drawn from the run's seeded generator, and their substitution into a copy of
a recorded request."""
from __future__ import annotations

import json
import re
from typing import Any

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class Ids:
    """Id factory over a numpy Generator (the replay's seeded one)."""

    def __init__(self, rng: Any) -> None:
        self.rng = rng

    def hex(self, n: int) -> str:
        return bytes(self.rng.integers(0, 256, size=(n + 1) // 2, dtype="uint8")).hex()[:n]

    def uuid4(self) -> str:
        h = self.hex(32)
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) % 4]}{h[17:20]}-{h[20:32]}"

    def uuid7(self, prefix: str) -> str:
        """A UUIDv7-looking id whose first 8 hex digits (the time's high bits) are ``prefix``, as the ids one Codex
        session makes within a few seconds share them."""
        h = self.hex(24)
        return f"{prefix}-{h[:4]}-7{h[4:7]}-{'89ab'[int(h[7], 16) % 4]}{h[8:11]}-{h[12:24]}"


def substituted(obj: Any, mapping: dict[str, str]) -> Any:
    """A copy of the JSON value ``obj`` with every occurrence of each key of ``mapping`` replaced (ids also sit
    inside JSON-in-a-string fields such as Claude Code's metadata.user_id and Codex's turn metadata)."""
    text = json.dumps(obj)
    for old, new in mapping.items():
        text = text.replace(old, new)
    return json.loads(text)


def session_scoped_uuids(obj: Any, session_id: str) -> list[str]:
    """The UUIDs in ``obj`` that belong to the recorded session: Codex's time-ordered ids made while it ran share the
    session id's first 8 hex digits (the installation id and fixed message ids do not)."""
    prefix = session_id[:8]
    return sorted({u for u in UUID_RE.findall(json.dumps(obj)) if u.startswith(prefix)})
