"""The ``output`` items of a response, built from the chat pipeline's parsed pieces, and the stream events that
build them (OpenAI's Responses streaming: ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``, ``response.reasoning_text.delta``, ``response.function_call_arguments.delta``, the
matching ``.done`` events, ``response.output_item.done``).

One builder serves both paths: a plain response feeds it the whole parse once and keeps only the items; a stream
feeds it each piece and sends the events. Items follow the generation: reasoning, then a message, then function
calls; a change of kind closes the open item.
"""
from __future__ import annotations

from typing import Any

from tierlm.server.api.responses.input import ToolNames
from tierlm.server.deps import new_id
from tierlm.server.pipeline.parsing.base import ParsedDelta
from tierlm.server.pipeline.parsing.tool_parsers import new_call_id

Event = dict[str, Any]


class OutputBuilder:
    def __init__(self, names: ToolNames) -> None:
        self.names = names
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # parser call index -> its item

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning"
                       for part in item.get("content") or [])

    def feed(self, d: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if d.reasoning:
            item = self._item("reasoning", events)
            item["content"][0]["text"] += d.reasoning
            events.append(self._at(item, {"type": "response.reasoning_text.delta", "content_index": 0,
                                          "delta": d.reasoning}))
        if d.content:
            item = self._item("message", events)
            item["content"][0]["text"] += d.content
            events.append(self._at(item, {"type": "response.output_text.delta", "content_index": 0,
                                          "delta": d.content, "logprobs": []}))
        for t in d.tool_calls:
            item = self._calls.get(t.index)
            if item is None:
                self._close(events)
                namespace, name = self.names.split(t.name or "")
                item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                        "call_id": t.id or new_call_id(), "name": name, "arguments": ""}
                if namespace:
                    item["namespace"] = namespace
                self._calls[t.index] = item
                self._add(item, events)
            if t.arguments:
                item["arguments"] += t.arguments
                events.append(self._at(item, {"type": "response.function_call_arguments.delta",
                                              "delta": t.arguments}))
        return events

    def finish(self, incomplete: bool = False) -> list[Event]:
        events: list[Event] = []
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    def _at(self, item: dict[str, Any], event: Event) -> Event:
        return {**event, "item_id": item["id"], "output_index": self.items.index(item)}

    def _item(self, kind: str, events: list[Event]) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close(events)
        if kind == "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self._add(item, events)
        events.append(self._at(item, {"type": "response.content_part.added", "content_index": 0,
                                      "part": {**item["content"][0]}}))
        self._open = item
        return item

    def _add(self, item: dict[str, Any], events: list[Event]) -> None:
        self.items.append(item)
        added = {**item, "content": []} if "content" in item else {**item}  # parts follow in content_part.added
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": added})
        if item["type"] == "function_call":
            self._open = item

    def _close(self, events: list[Event], status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            events.append(self._at(item, {"type": "response.function_call_arguments.done",
                                          "arguments": item["arguments"]}))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append(self._at(item, {"type": "response.reasoning_text.done", "content_index": 0,
                                              "text": part["text"]}))
            else:
                events.append(self._at(item, {"type": "response.output_text.done", "content_index": 0,
                                              "text": part["text"], "logprobs": []}))
            events.append(self._at(item, {"type": "response.content_part.done", "content_index": 0,
                                          "part": {**part}}))
        events.append({"type": "response.output_item.done", "output_index": self.items.index(item),
                       "item": _copy(item)})


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
