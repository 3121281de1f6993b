"""Reasoning parsers (qwen3, deepseek-r1) and the gpt-oss harmony parser on outputs written by hand from each
format's specification: whole, streamed in pieces split at every character boundary (and one character at a
time), unterminated and malformed."""
from __future__ import annotations

import itertools

import pytest

from tierlm.server.pipeline.parsing.base import ParsedDelta, ToolCallDelta
from tierlm.server.pipeline.parsing.harmony import HarmonyParser, parse_header
from tierlm.server.pipeline.parsing.reasoning import (REASONING_PARSER_NAMES, needs_special_tokens,
                                                      prompt_opens_thinking, reasoning_parser_for)


def run(parser, pieces) -> ParsedDelta:
    out = ParsedDelta()
    for p in pieces:
        out.extend(parser.feed(p))
    out.extend(parser.finish())
    return out


def calls(d: ParsedDelta) -> list[dict]:
    """Tool-call pieces merged per index: {"id", "name", "arguments"}; checks the streaming shape."""
    merged: dict[int, dict] = {}
    for c in d.tool_calls:
        if c.index not in merged:
            assert c.id and c.name, "the first piece of a call carries its id and name"
            merged[c.index] = {"id": c.id, "name": c.name, "arguments": c.arguments}
        else:
            assert c.id is None and c.name is None
            merged[c.index]["arguments"] += c.arguments
    return [merged[i] for i in sorted(merged)]


def splits(text: str):
    """The text whole, one character at a time, and cut in two and three at every boundary."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(0, len(text) + 1, 3), 2):
        yield [text[:i], text[i:j], text[j:]]


def check_all_splits(make, text: str, reasoning: str, content: str, tool_calls=None) -> None:
    for pieces in splits(text):
        d = run(make(), pieces)
        assert (d.reasoning, d.content) == (reasoning, content), pieces
        got = [{k: v for k, v in c.items() if k != "id"} for c in calls(d)]
        assert got == (tool_calls or []), pieces


# ---------------------------------------------------------------- qwen3

QWEN3 = [
    # (output, reasoning, content): thinking on; the newlines around the tags are formatting
    ("<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello!", "The user greets me.\nI greet back.", "Hello!"),
    # thinking off (enable_thinking: false puts an empty block in the prompt): all content
    ("Hello! How can I help?", "", "Hello! How can I help?"),
    # unterminated thinking (max_tokens reached): all reasoning
    ("<think>\nStill thinking about 2+2", "Still thinking about 2+2", ""),
    # text after the thinking keeps its own newlines and any later tags
    ("<think>a < b</think>x\n\ny </think> <think>z", "a < b", "x\n\ny </think> <think>z"),
    # a tool call inside the thinking ends it; the call stays in the content for the tool-call parser
    ("<think>need weather\n<tool_call>\n{\"name\": \"w\"}\n</tool_call>",
     "need weather", "<tool_call>\n{\"name\": \"w\"}\n</tool_call>"),
    # a stray </think> without <think> (thinking was off): content, untouched
    ("Answer</think>more", "", "Answer</think>more"),
    # almost a tag
    ("<thin>k", "", "<thin>k"),
    ("<think>a</thin", "a</thin", ""),
    ("", "", ""),
]


@pytest.mark.parametrize("text,reasoning,content", QWEN3)
def test_qwen3(text, reasoning, content):
    check_all_splits(lambda: reasoning_parser_for("qwen3"), text, reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", [
    ("The user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),  # the prompt ended in <think>\n
    ("no end in sight", "no end in sight", ""),
])
def test_qwen3_when_the_prompt_opened_the_thinking(text, reasoning, content):
    check_all_splits(lambda: reasoning_parser_for("qwen3", starts_in_reasoning=True), text, reasoning, content)
    check_all_splits(lambda: reasoning_parser_for("qwen3-thinking"), text, reasoning, content)


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


# ---------------------------------------------------------------- deepseek-r1

DEEPSEEK_R1 = [
    # the template's prompt ends in "<think>\n": the output starts inside the thinking
    ("I need to add 2 and 2.\n</think>\n\nThe answer is 4.", "I need to add 2 and 2.", "The answer is 4."),
    # R1-0528 repeats the opening tag
    ("<think>\nI need to add.</think>4", "I need to add.", "4"),
    # never closed: all reasoning
    ("thinking forever", "thinking forever", ""),
    ("</think>Only an answer", "", "Only an answer"),
    ("a\n\nb</think>\n\nc\n\nd</think>", "a\n\nb", "c\n\nd</think>"),
]


@pytest.mark.parametrize("text,reasoning,content", DEEPSEEK_R1)
def test_deepseek_r1(text, reasoning, content):
    check_all_splits(lambda: reasoning_parser_for("deepseek-r1"), text, reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("deepseek-r1", "a b c</think>d e", "a b c", "d e"),
    ("qwen3", "<think>a b c", "a b c", ""),
    ("gpt-oss", "<|channel|>analysis<|message|>a b<|end|><|start|>assistant<|channel|>final<|message|>c",
     "a b", "c"),
])
def test_stream_reasoning_false_sends_the_reasoning_in_one_piece(name, text, reasoning, content):
    check_all_splits(lambda: reasoning_parser_for(name, stream_reasoning=False), text, reasoning, content)
    for pieces in splits(text):
        parser = reasoning_parser_for(name, stream_reasoning=False)
        parts = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert [d.reasoning for d in parts if d.reasoning] == [reasoning]
        first = next(i for i, d in enumerate(parts) if d.reasoning)
        assert not "".join(d.content for d in parts[:first])


def test_separate_reasoning_false_leaves_think_tags_alone():
    assert reasoning_parser_for("qwen3", separate_reasoning=False) is None
    assert reasoning_parser_for("deepseek-r1", separate_reasoning=False) is None


def test_names_and_fresh_parsers():
    assert {"gpt-oss", "qwen3", "deepseek-r1"} <= set(REASONING_PARSER_NAMES)
    assert reasoning_parser_for("qwen3") is not reasoning_parser_for("qwen3")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser_for("nope")


def test_special_tokens_are_kept_only_when_the_parser_needs_them():
    assert needs_special_tokens("gpt-oss", [])
    assert not needs_special_tokens("qwen3", ["<|im_end|>"])  # <think> is an ordinary added token in Qwen3
    assert needs_special_tokens("qwen3", ["<think>", "</think>"])
    assert not needs_special_tokens(None, ["<think>"])


# ---------------------------------------------------------------- gpt-oss (harmony)
# Outputs follow OpenAI's harmony response format guide; the prompt ends with "<|start|>assistant".

ANALYSIS = "<|channel|>analysis<|message|>User asks: what is 2+2? Simple.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location":"Tokyo"}<|call|>')

HARMONY = [
    (ANALYSIS + FINAL, "User asks: what is 2+2? Simple.", "2 + 2 = 4.", []),
    # <|return|> is a stop token: its text is usually not in the output
    (ANALYSIS + FINAL[:-len("<|return|>")], "User asks: what is 2+2? Simple.", "2 + 2 = 4.", []),
    (ANALYSIS + CALL, "User asks: what is 2+2? Simple.", "",
     [{"name": "get_weather", "arguments": '{"location":"Tokyo"}'}]),
    # <|call|> is a stop token too
    (ANALYSIS + CALL[:-len("<|call|>")], "User asks: what is 2+2? Simple.", "",
     [{"name": "get_weather", "arguments": '{"location":"Tokyo"}'}]),
    # the recipient in the role part, a bare content type, two calls
    ('<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant to=functions.a<|channel|>commentary json'
     '<|message|>{"x": 1}<|call|><|start|>assistant<|channel|>commentary to=functions.b<|message|>{}<|call|>',
     "Two lookups.", "", [{"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": "{}"}]),
    # a commentary preamble (no recipient) is shown to the user: content
    ("<|channel|>commentary<|message|>Let me check.<|end|>" + CALL, "", "Let me check.",
     [{"name": "get_weather", "arguments": '{"location":"Tokyo"}'}]),
    # a built-in tool (not functions.*) is the model's own business: reasoning
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": \"x\"}<|call|>", '{"q": "x"}', "", []),
    # unterminated analysis (max_tokens reached)
    ("<|channel|>analysis<|message|>Thinking <and> more", "Thinking <and> more", "", []),
    # only a final answer
    ("<|channel|>final<|message|>Hi <|there|>!<|return|>", "", "Hi <|there|>!", []),
    # not harmony at all: content
    ("plain text, no markers", "", "plain text, no markers", []),
    # cut inside a header: nothing to show but what is there
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", "a", "", []),
    ("", "", "", []),
]


@pytest.mark.parametrize("text,reasoning,content,tool_calls", HARMONY)
def test_harmony(text, reasoning, content, tool_calls):
    check_all_splits(HarmonyParser, text, reasoning, content, tool_calls)


def test_harmony_streams_calls_in_openai_shape():
    p = HarmonyParser(call_id=lambda: "call_1")
    head = p.feed(ANALYSIS + CALL[:CALL.index("<|message|>") + len("<|message|>")])
    assert head.reasoning == "User asks: what is 2+2? Simple."
    assert head.tool_calls == [ToolCallDelta(index=0, id="call_1", name="get_weather")]
    assert p.feed('{"location":').tool_calls == [ToolCallDelta(index=0, arguments='{"location":')]
    assert p.feed('"Tokyo"}<|call|>').tool_calls == [ToolCallDelta(index=0, arguments='"Tokyo"}')]
    assert not p.finish()


def test_harmony_call_ids_are_distinct():
    d = run(HarmonyParser(), [ANALYSIS + CALL + CALL])
    ids = [c["id"] for c in calls(d)]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_harmony_separate_reasoning_false_puts_analysis_in_content():
    d = run(reasoning_parser_for("gpt-oss", separate_reasoning=False), [ANALYSIS + FINAL])
    assert (d.reasoning, d.content) == ("", "User asks: what is 2+2? Simple.2 + 2 = 4.")


@pytest.mark.parametrize("header,expected", [
    ("<|channel|>analysis", ("analysis", None)),
    ("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json", ("commentary", "functions.get_weather")),
    ("assistant to=functions.f<|channel|>commentary json", ("commentary", "functions.f")),
    ("<|channel|>final", ("final", None)),
])
def test_harmony_header(header, expected):
    assert parse_header(header) == expected
