"""ChatFormat: how a model's chats are written and read, decided once at startup (runtime/engine_setup.py) from the
flags, config.json's model_type and the chat template.

Where the chat template came from (its text stays with the tokenizer, which the server renders), the reasoning
parser and the tool-call parser (each a flag, or the one the model unambiguously needs, with why), the extra stop
tokens of the format and whether it is gpt-oss's harmony. The server builds its parsers from these names; the names
themselves are the server's flag values (server/pipeline/parsing), listed here only as far as a model can choose them
(tests/test_chat_templates.py holds the two lists together).
"""
from __future__ import annotations

from dataclasses import dataclass

HARMONY_PARSER = "gpt-oss"  # gpt-oss's harmony channels: the reasoning parser that also reads the tool calls
HARMONY_STOP_TOKENS = ("<|return|>", "<|call|>")  # gpt-oss: the answer is done / a tool call waits for its result
# the parser names a model can choose by itself (server/pipeline/parsing owns every name a flag may give)
DETECTED_REASONING_PARSERS = (HARMONY_PARSER, "qwen3")
DETECTED_TOOL_CALL_PARSERS = (HARMONY_PARSER, "qwen25", "hermes", "llama3", "mistral")


@dataclass(frozen=True)
class ChatFormat:
    chat_template_source: str | None = None  # where it came from; None: nowhere
    reasoning_parser: str | None = None
    reasoning_parser_source: str = ""  # why reasoning_parser is what it is (/server_info shows it)
    tool_call_parser: str | None = None
    tool_call_parser_source: str = ""  # why tool_call_parser is what it is
    extra_stop_tokens: tuple[str, ...] = ()  # stop tokens beyond the model's EOS ids (token text, not ids)

    @property
    def harmony(self) -> bool:
        """The output is harmony channels: one parser reads reasoning, content and tool calls together."""
        return self.reasoning_parser == HARMONY_PARSER


def decide_chat_format(model_type: str, template: str | None, template_source: str | None,
                       reasoning_flag: str | None, tool_call_flag: str | None) -> ChatFormat:
    """The format from --reasoning-parser / --tool-call-parser where given, else from config.json's ``model_type``
    and the chat template's text (``template``, as the tokenizer holds it)."""
    text = template or ""
    reasoning, reasoning_why = ((reasoning_flag, "--reasoning-parser") if reasoning_flag
                                else detect_reasoning_parser(model_type, text))
    tools, tools_why = ((tool_call_flag, "--tool-call-parser") if tool_call_flag
                        else detect_tool_call_parser(model_type, text))
    return ChatFormat(template_source, reasoning, reasoning_why, tools, tools_why,
                      HARMONY_STOP_TOKENS if reasoning == HARMONY_PARSER else ())


def detect_reasoning_parser(model_type: str, template: str) -> tuple[str | None, str]:
    """(parser name or None, why): gpt_oss -> gpt-oss; qwen3 with <think> in its chat template -> qwen3."""
    if model_type == "gpt_oss":
        return HARMONY_PARSER, "the model (model_type gpt_oss: harmony channels)"
    if model_type in ("qwen3", "qwen3_moe") and "<think>" in template:
        return "qwen3", f"the model (model_type {model_type}, <think> in its chat template)"
    return None, "none: the model needs none that is known; set --reasoning-parser to choose one"


def detect_tool_call_parser(model_type: str, template: str) -> tuple[str | None, str]:
    """(parser name or None, why) from config.json's model_type and the chat template's text."""
    if model_type == "gpt_oss":
        return HARMONY_PARSER, "the model (model_type gpt_oss: harmony commentary channel)"
    if "<tool_call>" in template:
        name = "qwen25" if model_type.startswith("qwen") else "hermes"
        return name, f"the model (model_type {model_type}, <tool_call> in its chat template)"
    if "<|python_tag|>" in template and model_type.startswith("llama"):
        return "llama3", f"the model (model_type {model_type}, <|python_tag|> in its chat template)"
    if "[TOOL_CALLS]" in template:
        return "mistral", f"the model (model_type {model_type}, [TOOL_CALLS] in its chat template)"
    return None, ("none: the chat template names no known tool-call format; tools still reach the template, calls "
                  "are not parsed; set --tool-call-parser to choose one")
