"""Tool-call parsers (server/pipeline/parsing/tool_parsers.py) on outputs written from each format's specification:
a complete call, every split point for streaming (the result never depends on how the text arrives), malformed
calls (kept as content), text before a call, two calls; the OpenAI streaming shape of the pieces; the pipeline;
the grammar of forced calls compiles and accepts what the parser reads."""
from __future__ import annotations

import json

import pytest

from tierlm.server.pipeline.parsing.base import ParsedDelta
from tierlm.server.pipeline.parsing.harmony import HarmonyParser
from tierlm.server.pipeline.parsing.pipeline import ChoiceParser, assemble_calls
from tierlm.server.pipeline.parsing.tool_parsers import (HermesToolParser, JsonListToolParser, Llama3ToolParser,
                                                         MistralToolParser)
from tierlm.server.pipeline.parsing.tool_registry import TOOL_CALL_PARSERS, forced_call_grammar, tool_parser_for

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris \\"CET\\" {x}"}}'

# (parser, output, expected content, expected [(name, arguments object)])
CASES = {
    "hermes-call": (HermesToolParser, f"<tool_call>\n{WEATHER}\n</tool_call>", "",
                    [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "hermes-text-then-two-calls": (
        HermesToolParser, f"Let me check both.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        "Let me check both.\n",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": 'Europe/Paris "CET" {x}'})]),
    "hermes-keys-reversed": (HermesToolParser, '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', "",
                             [("f", {"a": 1})]),
    "hermes-no-arguments": (HermesToolParser, '<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
    "hermes-malformed": (HermesToolParser, "Hi <tool_call>\n{not json}\n</tool_call> bye",
                         "Hi <tool_call>\n{not json}\n</tool_call> bye", []),
    "hermes-marker-without-object": (HermesToolParser, "a <tool_call> b", "a <tool_call> b", []),
    "hermes-truncated-before-name": (HermesToolParser, 'x <tool_call>\n{"na', 'x <tool_call>\n{"na', []),
    "hermes-plain-text": (HermesToolParser, "no <b>calls</b> here <tool", "no <b>calls</b> here <tool", []),
    "llama3-call": (Llama3ToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
                    [("get_weather", {"city": "Paris"})]),
    "llama3-python-tag-two-calls": (
        Llama3ToolParser, '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "parameters": {}}',
        "", [("a", {"x": [1, 2]}), ("b", {})]),
    "llama3-json-answer-is-content": (Llama3ToolParser, '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    "llama3-text": (Llama3ToolParser, "The weather is {sunny}.", "The weather is {sunny}.", []),
    "llama3-text-then-python-tag": (Llama3ToolParser, 'Sure. <|python_tag|>{"name": "f", "parameters": {"q": 1}}',
                                    "Sure. ", [("f", {"q": 1})]),
    "mistral-two-calls": (
        MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                           '{"name": "get_time", "arguments": {}}]',
        "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "mistral-text-then-call": (MistralToolParser, 'Checking.[TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}]',
                               "Checking.", [("f", {"a": "]"})]),
    "mistral-malformed": (MistralToolParser, "[TOOL_CALLS] oops [1]", "[TOOL_CALLS] oops [1]", []),
    "json-list": (JsonListToolParser, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "",
                  [("f", {"a": 1}), ("g", {})]),
}


def run(parser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[ParsedDelta]]:
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls = assemble_calls([t for d in deltas for t in d.tool_calls])
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], deltas


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_output(case):
    cls, text, content, calls = CASES[case]
    got_content, got_calls, _ = run(cls(), [text])
    assert (got_content, got_calls) == (content, calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_split_gives_the_same_result(case):
    cls, text, content, calls = CASES[case]
    assert run(cls(), list(text))[:2] == (content, calls)  # one character at a time
    for i in range(len(text) + 1):  # and every two-piece split
        assert run(cls(), [text[:i], text[i:]])[:2] == (content, calls), i


def test_streaming_shape_first_piece_has_id_and_name_then_argument_fragments():
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    _, _, deltas = run(HermesToolParser(), list(text))
    pieces = [t for d in deltas for t in d.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].name == "get_weather" and pieces[0].index == 0
    assert all(p.id is None and p.name is None for p in pieces[1:])
    assert len(pieces) > 10  # the arguments arrive as they are generated, not at the end
    assert "".join(p.arguments for p in pieces) == '{"city": "Paris", "unit": "celsius"}'


def test_content_before_a_call_is_released_before_the_call_completes():
    p = HermesToolParser()
    assert p.feed("Hello <to").content == "Hello "  # "<to" may open a marker: held back
    assert p.feed("ol_call>\n{").content == ""
    assert p.feed('"name": "f", "arguments": {').tool_calls[0].name == "f"


def test_pipeline_runs_reasoning_then_tools_and_keeps_one_call_without_parallel():
    class Think:  # a stand-in reasoning parser: text up to "|" is reasoning
        def __init__(self):
            self.done = False

        def feed(self, text):
            if self.done:
                return ParsedDelta(content=text)
            head, sep, tail = text.partition("|")
            self.done = bool(sep)
            return ParsedDelta(reasoning=head, content=tail)

        def finish(self):
            return ParsedDelta()

    text = f"hmm|ok <tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    pipe = ChoiceParser(Think(), HermesToolParser(), parallel_tool_calls=False)
    deltas = [pipe.feed(c) for c in text] + [pipe.finish()]
    assert "".join(d.reasoning for d in deltas) == "hmm"
    assert "".join(d.content for d in deltas) == "ok "
    calls = assemble_calls([t for d in deltas for t in d.tool_calls])
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and pipe.called


def test_registry_names():
    assert {"qwen25", "hermes", "llama3", "mistral", "gpt-oss"} <= set(TOOL_CALL_PARSERS)
    assert isinstance(tool_parser_for("qwen25"), HermesToolParser)
    assert tool_parser_for("gpt-oss") is None  # the harmony parser reads gpt-oss calls


@pytest.mark.parametrize("fmt,parser,sample", [
    ("hermes", HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("llama3", Llama3ToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    (None, JsonListToolParser, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
    ("harmony", HarmonyParser,
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
])
def test_forced_call_grammar_accepts_what_the_parser_reads(fmt, parser, sample):
    xgr = pytest.importorskip("xgrammar")
    from tierlm.backends.grammar.xgrammar_backend import structural_tag_grammar

    functions = [{"name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}},
                 {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    grammar = structural_tag_grammar(forced_call_grammar(fmt, functions, parallel=True))
    assert xgr.testing._is_grammar_accept_string(grammar, sample)
    assert not xgr.testing._is_grammar_accept_string(grammar, sample.replace('"Paris"', "3"))
    assert not xgr.testing._is_grammar_accept_string(grammar, "hello")
    assert run(parser(), [sample])[1] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("model_type,template,expected", [
    ("qwen2", "...<tool_call>\n{...}</tool_call>...", "qwen25"),
    ("llama", "{{ '<tool_call>' }}", "hermes"),  # a Hermes fine-tune of Llama
    ("llama", "{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
    ("mistral", "[AVAILABLE_TOOLS]...[TOOL_CALLS]", "mistral"),
    ("gpt_oss", "", "gpt-oss"),
    ("llama", "{% for m in messages %}{{ m.content }}{% endfor %}", None),
])
def test_parser_chosen_from_the_model(model_type, template, expected):
    from tierlm.runtime.chat_format import detect_tool_call_parser

    name, why = detect_tool_call_parser(model_type, template)
    assert name == expected and why
    assert name is None or name in TOOL_CALL_PARSERS


def test_cli_flag():
    from tierlm.server.commands.cli_args import parse_args

    assert parse_args(["--tool-call-parser", "qwen25"]).tool_call_parser == "qwen25"
    assert parse_args([]).tool_call_parser is None
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "nope"])
