"""The capture server of `tierlm bench agent --record`: it records every request a real client CLI sends and answers
with scripted, streamed replies, so the CLI runs its real agent loop (tool calls, sub-agents, resumes) in seconds
and without a model.

Scripts: Claude Code (/v1/messages) gets a thinking block where it asked for thinking, then a Read call per file in
``reads`` (counted by the tool_results the conversation holds), then a final text; with ``agent`` set, a session
that offers the Agent tool first calls an Explore sub-agent (the sub-agent, offered no Agent tool, gets the Read
calls). Codex (/v1/responses) gets a reasoning item, then an exec_command ``cat <file>`` call per file, then a final
message. Anything else (HEAD /, count_tokens, telemetry a CLI may still try) is answered empty and recorded.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

FINAL_TEXT = "Done: the code looks fine."
AGENT_INPUT = {"description": "Summarize {name}", "prompt": "Read {rel} and summarize what it holds.",
               "subagent_type": "Explore"}


@dataclass
class Captured:
    """One request as the server received it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any
    at: float = field(default_factory=time.time)


@dataclass
class Script:
    """What the capture server answers: the files to read (absolute paths), one per tool round; whether a session
    offered the Agent tool calls a sub-agent first (``agent_target``: the repository path it asks about)."""

    reads: list[str] = field(default_factory=list)
    agent_target: str | None = None


def _hex(n: int) -> str:
    return uuid.uuid4().hex[:n]


def sse(events: list[tuple[str, dict[str, Any]]]) -> Iterator[str]:
    for name, data in events:
        yield f"event: {name}\ndata: {json.dumps(data)}\n\n"


def tool_results(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "user" and isinstance(m.get("content"), list)
               and any(b.get("type") == "tool_result" for b in m["content"]))


def agent_called(messages: list[dict[str, Any]]) -> bool:
    return any(b.get("type") == "tool_use" and b.get("name") == "Agent" for m in messages
               if m.get("role") == "assistant" and isinstance(m.get("content"), list) for b in m["content"])


def _block(index: int, start: dict[str, Any], delta: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    out = [("content_block_start", {"type": "content_block_start", "index": index, "content_block": start})]
    if delta is not None:
        out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
    return out + [("content_block_stop", {"type": "content_block_stop", "index": index})]


def messages_reply(body: dict[str, Any], script: Script) -> list[tuple[str, dict[str, Any]]]:
    """Claude Code's next scripted answer (module docstring) as Anthropic stream events."""
    msgs = body.get("messages") or []
    done = tool_results(msgs)
    tools = [t.get("name") for t in body.get("tools") or []]
    usage = {"input_tokens": 10, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    ev = [("message_start", {"type": "message_start", "message": {
        "id": "msg_" + _hex(24), "type": "message", "role": "assistant", "model": body.get("model"), "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}})]
    idx = 0
    if (body.get("thinking") or {}).get("type") in ("adaptive", "enabled"):
        ev += _block(idx, {"type": "thinking", "thinking": "", "signature": ""},
                     {"type": "thinking_delta", "thinking": f"Let me look at the next file ({done})."})
        ev.insert(-1, ("content_block_delta", {"type": "content_block_delta", "index": idx,
                                               "delta": {"type": "signature_delta", "signature": "sig" + _hex(32)}}))
        idx += 1
    stop = "tool_use"
    if script.agent_target and "Agent" in tools and not agent_called(msgs):
        rel = script.agent_target
        args = {k: v.format(rel=rel, name=rel.rsplit("/", 1)[-1]) for k, v in AGENT_INPUT.items()}
        ev += _block(idx, {"type": "tool_use", "id": "toolu_" + _hex(24), "name": "Agent", "input": {}},
                     {"type": "input_json_delta", "partial_json": json.dumps(args)})
    elif "Read" in tools and done < len(script.reads) and not agent_called(msgs):
        ev += _block(idx, {"type": "text", "text": ""}, {"type": "text_delta", "text": "I will read the file."})
        ev += _block(idx + 1, {"type": "tool_use", "id": "toolu_" + _hex(24), "name": "Read", "input": {}},
                     {"type": "input_json_delta", "partial_json": json.dumps({"file_path": script.reads[done]})})
    else:
        ev += _block(idx, {"type": "text", "text": ""}, {"type": "text_delta", "text": FINAL_TEXT})
        stop = "end_turn"
    return ev + [("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                    "usage": {"output_tokens": 12}}),
                 ("message_stop", {"type": "message_stop"})]


def responses_reply(body: dict[str, Any], script: Script) -> list[tuple[str, dict[str, Any]]]:
    """Codex's next scripted answer (module docstring) as Responses stream events."""
    items = body.get("input") if isinstance(body.get("input"), list) else []
    done = sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")
    tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    base = {"id": "resp_" + _hex(24), "object": "response", "created_at": int(time.time()),
            "model": body.get("model"), "status": "in_progress", "output": []}
    reasoning = {"type": "reasoning", "id": "rs_" + _hex(20),
                 "summary": [{"type": "summary_text", "text": f"Looking at file {done}."}]}
    if "exec_command" in tools and done < len(script.reads):
        item: dict[str, Any] = {"type": "function_call", "id": "fc_" + _hex(20), "call_id": "call_" + _hex(20),
                                "name": "exec_command", "arguments": json.dumps({"cmd": f"cat {script.reads[done]}"}),
                                "status": "completed"}
    else:
        item = {"type": "message", "id": "msg_" + _hex(20), "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": FINAL_TEXT, "annotations": []}]}
    ev = [("response.created", {"type": "response.created", "response": base})]
    for i, it in enumerate((reasoning, item)):
        ev += [("response.output_item.added", {"type": "response.output_item.added", "output_index": i, "item": it}),
               ("response.output_item.done", {"type": "response.output_item.done", "output_index": i, "item": it})]
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    return ev + [("response.completed", {"type": "response.completed",
                                         "response": {**base, "status": "completed", "output": [reasoning, item],
                                                      "usage": usage}})]


class CaptureServer:
    """The app on a free loopback port, served by uvicorn on a thread; ``captured`` holds every request."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.captured: list[Captured] = []
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def record(request: Request) -> Any:
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            self.captured.append(Captured(request.method, request.url.path, str(request.url.query),
                                          dict(request.headers), body))
            return body

        async def messages(request: Request) -> Response:
            body = await record(request)
            if not isinstance(body, dict) or not body.get("stream"):
                return JSONResponse({"error": "the capture server scripts streamed requests only"}, status_code=400)
            return StreamingResponse(sse(messages_reply(body, self.script)), media_type="text/event-stream")

        async def count_tokens(request: Request) -> Response:
            await record(request)
            return JSONResponse({"input_tokens": 100})

        async def other(request: Request) -> Response:
            body = await record(request)
            if request.url.path == "/v1/responses" and isinstance(body, dict):
                return StreamingResponse(sse(responses_reply(body, self.script)), media_type="text/event-stream")
            return JSONResponse({})

        return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                                 Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
                                 Route("/{p:path}", other, methods=["GET", "POST", "HEAD"])])

    def __enter__(self) -> "CaptureServer":
        import uvicorn

        from tierlm.server.commands.bench.server_process import free_port

        self.port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="capture-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the capture server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def take(self) -> list[Captured]:
        """The requests captured since the last take."""
        out, self.captured = self.captured, []
        return out
