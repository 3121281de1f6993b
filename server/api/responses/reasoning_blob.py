"""``encrypted_content`` of a reasoning item: the exact tokens of a turn, carried by a client that does not store
responses (Codex CLI sends ``store: false`` with ``include: ["reasoning.encrypted_content"]``).

The blob is opaque and integrity-checked, not secret: zlib-compressed JSON (the turn's prompt + output token ids,
and a hash of the rendered prompt they came from), then an HMAC-SHA256 under a per-server key. The key is random per
process unless TIERLM_RESPONSES_SECRET sets it (so blobs survive a restart, or are shared by replicas behind a
router). A blob that fails the check is a 400: the ids go straight into the prompt, so a client must not forge them.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import zlib
from dataclasses import dataclass

from tierlm.runtime.errors import RequestError

_PREFIX = "tierlm1."  # the format's version: a later format can still tell these apart
_KEY = (os.environ.get("TIERLM_RESPONSES_SECRET", "").encode() or secrets.token_bytes(32))


@dataclass(frozen=True)
class TurnTokens:
    """What a turn left in the KV cache: its prompt and output token ids (without the stop token, whose KV is never
    computed), and the sha256 of the prompt text they were rendered from (the next turn checks it still renders so)."""

    ids: list[int]
    prompt_hash: str
    # server/api/responses/prefix.assistant_digest of the turn's output as the conversation carries it back: the ids are
    # spliced in only while the client sends that same output ("" never matches: render the conversation whole)
    output_digest: str = ""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def seal(turn: TurnTokens) -> str:
    payload = zlib.compress(json.dumps({"ids": turn.ids, "h": turn.prompt_hash, "o": turn.output_digest},
                                      separators=(",", ":")).encode(), 6)
    mac = hmac.new(_KEY, payload, hashlib.sha256).digest()
    return _PREFIX + _b64(payload) + "." + _b64(mac)


def unseal(blob: str, param: str) -> TurnTokens:
    """The turn in a blob this server (or one with the same TIERLM_RESPONSES_SECRET) made; a 400 otherwise."""
    bad = RequestError(f"{param} is not a reasoning blob made by this server (it was changed, or made by another "
                       "server instance: set TIERLM_RESPONSES_SECRET alike on every instance and across restarts)",
                       400, param=param, code="invalid_encrypted_content")
    if not blob.startswith(_PREFIX) or blob.count(".") != 2:
        raise bad
    body, _, mac_text = blob[len(_PREFIX):].partition(".")
    try:
        payload, mac = _unb64(body), _unb64(mac_text)
    except ValueError:
        raise bad from None
    if not hmac.compare_digest(mac, hmac.new(_KEY, payload, hashlib.sha256).digest()):
        raise bad
    data = json.loads(zlib.decompress(payload))  # ours: the MAC says so
    return TurnTokens(ids=[int(t) for t in data["ids"]], prompt_hash=str(data["h"]), output_digest=str(data.get("o", "")))
