"""The prompt tokens tierlm makes of each replayed request, computed in the bench process: the model's tokenizer
and chat template loaded as the server loads them (runtime/engine_setup.tokenizer_for with the server's own flags),
each body converted by tierlm's own converters (Anthropic: billing header left out as the server does,
server/api/anthropic/convert.py's to_chat_request, a late system message folded where the template refuses it;
Responses: server/api/responses/input.py's conversation and chat_request, then prefix.py's build_prompt) and
rendered by server/pipeline/tokenization.py's apply_chat_template.

Exact for the replay: its Responses requests carry no encrypted_content (scripted assistant turns), so the server
renders each conversation whole, which is what build_prompt does without an earlier turn. What it gives:
the longest prompt (the server's context length is sized from it), and where each prompt first differs from the
previous request's prompt of its conversation ("diverged at": the prefix a cache can reuse at most).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from tierlm.runtime.errors import RequestError
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.commands.bench.agent.plan import PlannedRequest

log = logging.getLogger("tierlm.bench")


@dataclass
class Rendered:
    """One request's prompt as tierlm renders it."""

    ids: list[int]
    folded: bool = False  # a late system message was folded into a user turn (the template refused it)


def server_args_of(flags: Sequence[str]) -> ServerArgs:
    """The ServerArgs `tierlm serve` would make of ``flags`` (the bench's own server flags)."""
    from tierlm.server.commands.cli_args import parse_args

    return parse_args(list(flags), prog="tierlm bench agent (server flags)")


class PromptRenderer:
    """tierlm's prompt of a request, without a server (see the module docstring)."""

    def __init__(self, args: ServerArgs, model_dir: Path) -> None:
        from tierlm.runtime.engine_setup import tokenizer_for
        from tierlm.server.pipeline.tokenization import TemplatePolicy

        self.args = args
        self.tokenizer, self.template_source = tokenizer_for(args, Path(model_dir))
        if hasattr(self.tokenizer, "model_max_length"):  # no "longer than the maximum" warning: the server's
            self.tokenizer.model_max_length = 2**62       # context length is set from these prompts
        self.policy = TemplatePolicy.of(args)
        self.engine = SimpleNamespace(tokenizer=self.tokenizer, args=args)  # what chat_prompt_ids reads
        log.info("agent: prompts rendered with the chat template of %s", self.template_source or "the model")

    def render(self, req: PlannedRequest) -> Rendered:
        if req.path.endswith("/responses"):
            return Rendered(self._responses(req.body))
        return self._messages(req.body)

    def _messages(self, raw: dict[str, Any]) -> Rendered:
        from tierlm.server.api.anthropic.billing_header import without_billing_header
        from tierlm.server.api.anthropic.convert import refused_late_system, to_chat_request
        from tierlm.server.api.anthropic.protocol import MessagesRequest
        from tierlm.server.pipeline.chat import chat_prompt_ids

        body = without_billing_header(MessagesRequest.model_validate(raw), self.args.keep_anthropic_billing_header)
        try:
            return Rendered(chat_prompt_ids(self.engine, to_chat_request(body)))  # type: ignore[arg-type]
        except RequestError as e:  # the route's own fallback (messages.py _with_folding)
            if not refused_late_system(e, body):
                raise
        return Rendered(chat_prompt_ids(self.engine, to_chat_request(body, fold_system=True)),  # type: ignore[arg-type]
                        folded=True)

    def _responses(self, raw: dict[str, Any]) -> list[int]:
        from tierlm.server.api.responses.input import chat_request, chat_tools, conversation, input_items
        from tierlm.server.api.responses.prefix import build_prompt
        from tierlm.server.api.responses.protocol import ResponsesRequest
        from tierlm.server.pipeline.chat import template_kwargs
        from tierlm.server.pipeline.tools import template_tools

        body = ResponsesRequest.model_validate(raw)
        items = input_items(body)
        conv = conversation(body.instructions, items, [f"input[{j}]" for j in range(len(items))])
        tools, _ = chat_tools(body.tools)
        chat = chat_request(body, conv.messages, tools)
        kwargs = {**template_kwargs(chat), **template_tools(chat)}
        return build_prompt(self.tokenizer, chat.messages, kwargs, self.policy, None).ids

    def fit(self, text: str, tokens: int) -> str:
        """``text`` cut to about ``tokens`` tokens of this tokenizer (by its characters per token)."""
        n = len(self.tokenizer.encode(text, add_special_tokens=False))
        return text if n <= tokens else text[:max(1, len(text) * tokens // n)]


def diverged_at(previous: list[int] | None, current: list[int]) -> int | None:
    """The first position where ``current`` differs from ``previous`` (their common prefix length); None without a
    previous prompt."""
    if previous is None:
        return None
    n = min(len(previous), len(current))
    a, b = np.asarray(previous[:n]), np.asarray(current[:n])
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else n


def render_all(renderer: PromptRenderer, requests: Sequence[PlannedRequest]) -> dict[int, Rendered]:
    """Every request's prompt, keyed by id(request)."""
    return {id(r): renderer.render(r) for r in requests}


def previous_in_chain(requests: Sequence[PlannedRequest]) -> dict[int, PlannedRequest]:
    """id(request) -> the request before it in its conversation (``chain``), in the order a session sends them."""
    last: dict[str, PlannedRequest] = {}
    out: dict[int, PlannedRequest] = {}
    for r in requests:
        if r.chain in last:
            out[id(r)] = last[r.chain]
        last[r.chain] = r
    return out
