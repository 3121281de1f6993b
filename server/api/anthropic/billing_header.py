"""Claude Code's billing header: a first system block ``x-anthropic-billing-header: cc_version=<version>.<3 hex>;
cc_entrypoint=...;`` whose hash changes with every prompt (newer versions add a per-request ``cch=``). It means
nothing to the model, but it sits before the tools and instructions, so a second session (or, with ``cch=``, every
request) would miss the whole cached prefix behind it. It is left out of the prompt, as vLLM does; the server's
--keep-anthropic-billing-header keeps it (docs/api.md)."""
from __future__ import annotations

import logging
import threading
from typing import TypeVar

from tierlm.server.api.anthropic.protocol import CountTokensRequest

logger = logging.getLogger("tierlm.server")
PREFIX = "x-anthropic-billing-header:"
_logged = threading.Event()
Body = TypeVar("Body", bound=CountTokensRequest)


def is_billing_header(text: str) -> bool:
    return text.lstrip().startswith(PREFIX)


def without_billing_header(body: Body, keep: bool) -> Body:
    """``body`` without its billing-header system blocks (``body`` itself when it has none, or ``keep``)."""
    if keep or not isinstance(body.system, list) or not any(is_billing_header(b.text) for b in body.system):
        return body
    if not _logged.is_set():
        _logged.set()
        logger.info("anthropic messages: the client's x-anthropic-billing-header system block (Claude Code's, with a "
                    "hash that changes every prompt) is left out of the prompt so sessions share their cached prefix; "
                    "--keep-anthropic-billing-header keeps it (logged once)")
    return body.model_copy(update={"system": [b for b in body.system if not is_billing_header(b.text)] or None})
