"""A small but real implementation of the Engine API for HTTP-layer tests.

Tokens are characters (id = ord(char)), so prompts and outputs are easy to reason about. The model "echoes":
output token i is prompt token i (cycling). It honours max_new_tokens, stop strings, stop_token_ids and
reports prompt-cache hits (a prompt seen before has all but its last token cached on the device tier).
Knobs let a test make it slow, hang, fail in-band, or raise.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from tierlm.runtime.chat_format import decide_chat_format
from tierlm.runtime.errors import RequestError
from tierlm.runtime.io_struct import CachedTokens, GenerateOutput, GenerateRequest
from tierlm.runtime.server_args import ServerArgs

VOCAB_SIZE = 0x110000  # every Unicode code point is a token


class FakeTokenizer:
    # raise_template_error (a chat_template_kwargs key) makes the template refuse the conversation, as real ones do
    chat_template: str | None = ("{% if raise_template_error %}{{ raise_exception('Conversation roles must alternate "
                                 "user/assistant') }}{% endif %}"
                                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    all_special_tokens: list[str] = []
    special_tokens_map: dict[str, Any] = {}

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


class FakeEngine:
    def __init__(self, args: ServerArgs | None = None, ready: bool = True, context_length: int = 4096) -> None:
        self.args = args or ServerArgs(model_path="fake/model")
        self.ready = ready
        self.tokenizer = FakeTokenizer()
        # as the engine decides it: the flags, else nothing (the fake model type needs no parser)
        self.chat_format = decide_chat_format("fake", self.tokenizer.chat_template, "the model's tokenizer",
                                              self.args.reasoning_parser, self.args.tool_call_parser)
        self.context_length = context_length
        self.received: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.flushed: list[bool] = []
        self.seen_prompts: set[tuple[int, ...]] = set()
        # knobs
        self.token_delay_s = 0.0
        self.hang_after_tokens: int | None = None  # stop producing (until cancelled) after this many tokens
        self.error_after_tokens: int | None = None  # emit an in-band error after this many tokens
        self.raise_in_generate: Exception | None = None
        self.fail_rid_suffix = ""  # with error_after_tokens: only requests whose rid ends with this fail
        self.flush_result = True
        self.script: str | None = None  # the model's output text instead of the echo; then it stops (EOS)

    # -- Engine API --------------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        if not req.input_ids:
            raise RequestError("the prompt is empty: send at least one token", param="prompt")
        bad = [t for t in req.input_ids if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{VOCAB_SIZE - 1})", param="prompt")
        total = len(req.input_ids) + req.sampling_params.max_new_tokens
        if total > self.context_length:
            raise RequestError(f"maximum context length is {self.context_length} tokens, requested {total}",
                               param="max_tokens", code="context_length_exceeded")

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self.received.append(req)
        if self.raise_in_generate is not None:
            raise self.raise_in_generate
        sp = req.sampling_params
        prompt = tuple(req.input_ids)
        cached = CachedTokens(device=len(prompt) - 1) if prompt in self.seen_prompts else CachedTokens()
        self.seen_prompts.add(prompt)
        fails = req.rid.endswith(self.fail_rid_suffix)
        produced: list[int] = []
        text = ""
        for step in range(sp.max_new_tokens + 1):
            if self.error_after_tokens is not None and fails and step == self.error_after_tokens:
                yield GenerateOutput(rid=req.rid, finished=True, finish_reason="abort", error="fake model exploded",
                                     prompt_tokens=len(prompt), completion_tokens=len(produced))
                return
            if self.hang_after_tokens is not None and step == self.hang_after_tokens:
                await asyncio.Event().wait()  # forever, until the HTTP layer cancels us
            if self.script is not None and step == len(self.script) and step < sp.max_new_tokens:
                yield self._final(req, "stop", None, len(prompt), produced, cached)
                return
            if step == sp.max_new_tokens:
                yield self._final(req, "length", None, len(prompt), produced, cached)
                return
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            token = ord(self.script[step]) if self.script is not None else prompt[step % len(prompt)]
            produced.append(token)
            if token in sp.stop_token_ids:
                yield self._final(req, "stop", token, len(prompt), produced, cached)
                return
            piece = chr(token)
            text += piece
            matched = next((s for s in sp.stop if text.endswith(s)), None)
            if matched is not None:  # the stop string is left out of the output (tests use 1-char stops)
                yield self._final(req, "stop", matched, len(prompt), produced, cached)
                return
            yield GenerateOutput(rid=req.rid, text=piece, token_ids=[token], prompt_tokens=len(prompt),
                                 completion_tokens=len(produced), cached=cached)  # as the engine's deltas

    def _final(self, req: GenerateRequest, reason: str, matched: Any, n_prompt: int, produced: list[int],
               cached: CachedTokens) -> GenerateOutput:
        return GenerateOutput(rid=req.rid, finished=True, finish_reason=reason, matched_stop=matched,
                              prompt_tokens=n_prompt, completion_tokens=len(produced), cached=cached,
                              pinned_tokens=max((p.tokens for p in req.pins), default=0))

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def compile_grammar(self, params) -> None:
        """No grammar compiler here: the fake engine refuses every grammar as --grammar-backend none does."""
        from tierlm.runtime.grammar.spec import grammar_spec

        spec = grammar_spec(params)
        if spec is not None:
            raise RequestError(f"structured output is turned off on this server; remove '{spec.param}'", 400,
                               param=spec.param, code="invalid_grammar")

    async def flush_cache(self, storage: bool = False) -> bool:
        self.flushed.append(storage)
        if self.flush_result:
            self.seen_prompts.clear()
        return self.flush_result

    def check_token_ids(self, ids, param: str) -> None:
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            bad = next(t for t in ids if not 0 <= t < VOCAB_SIZE)
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{VOCAB_SIZE - 1})", param=param)

    async def get_load(self) -> dict[str, int]:
        return {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}

    def server_info(self) -> dict[str, Any]:
        return {"ready": self.ready, "server_args": self.args.to_dict(), "backend": "fake"}

    def metrics_text(self) -> bytes:
        return b"# HELP tierlm_requests_total Requests.\n# TYPE tierlm_requests_total counter\ntierlm_requests_total 3.0\n"

    def shutdown(self) -> None:
        self.ready = False
