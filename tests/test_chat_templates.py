"""--chat-template resolution (built-in names, files, inline text) and the startup errors; the reasoning parser
chosen from the model; gpt-oss's stop tokens."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierlm.backends.model_source import ModelSourceError
from tierlm.backends.model_source.chat_templates import BUILTIN_CHAT_TEMPLATES, resolve_chat_template
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.model_source.tokenizer import load_tokenizer, save_byte_tokenizer
from tierlm.runtime import engine_setup
from tierlm.runtime.chat_format import (DETECTED_REASONING_PARSERS, DETECTED_TOOL_CALL_PARSERS, HARMONY_PARSER,
                                        HARMONY_STOP_TOKENS)
from tierlm.runtime.errors import StartupError
from tierlm.runtime.server_args import ServerArgs


def test_builtin_names_files_and_inline(tmp_path: Path) -> None:
    for name in ("chatml", "chatml-tools", "qwen2.5"):
        assert resolve_chat_template(name) == (BUILTIN_CHAT_TEMPLATES[name], f"built-in template '{name}'")
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert resolve_chat_template(str(f)) == ("{{ messages[0]['content'] }}", f"file {f}")
    j = tmp_path / "tokenizer_config.json"
    j.write_text(json.dumps({"chat_template": "{{ 'x' }}"}), encoding="utf-8")
    assert resolve_chat_template(str(j))[0] == "{{ 'x' }}"
    assert resolve_chat_template("{{ 'inline' }}")[1] == "the template given inline"


@pytest.mark.parametrize("value,message", [
    ("no/such/file.jinja", "neither a file nor a built-in template name"),
    ("{% if x %}never closed", "not a valid jinja template"),
])
def test_bad_templates_are_startup_errors(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(ModelSourceError, match=message):
        resolve_chat_template(value)
    save_byte_tokenizer(tmp_path)
    with pytest.raises(StartupError, match=message):
        engine_setup.tokenizer_for(ServerArgs(chat_template=value), tmp_path)


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jinja"
    f.write_text("line one\n{{ ok }}\n{% for %}\n", encoding="utf-8")
    with pytest.raises(ModelSourceError, match=r"line 3"):
        resolve_chat_template(str(f))


def test_template_replaces_the_models_own(tmp_path: Path) -> None:
    save_byte_tokenizer(tmp_path, chat_template=None)
    tok, source = engine_setup.tokenizer_for(ServerArgs(), tmp_path)
    assert not tok.chat_template and source is None
    tok, source = engine_setup.tokenizer_for(ServerArgs(chat_template="chatml-tools"), tmp_path)
    assert tok.chat_template == BUILTIN_CHAT_TEMPLATES["chatml-tools"] and "chatml-tools" in source
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    assert "<tools>" in text and '"get_weather"' in text and text.endswith("<|im_start|>assistant\n")
    assert load_tokenizer(tmp_path, chat_template="{{ 'x' }}").chat_template == "{{ 'x' }}"


@pytest.mark.parametrize("model_type,template,flag,expected", [
    ("gpt_oss", "", None, "gpt-oss"),
    ("qwen3", "{{ '<think>' }}", None, "qwen3"),
    ("qwen3_moe", "{{ '<think>' }}", None, "qwen3"),
    ("qwen3", "{{ 'no thinking here' }}", None, None),
    ("llama", "{{ '<think>' }}", None, None),
    ("gpt_oss", "", "deepseek-r1", "deepseek-r1"),  # the flag wins
])
def test_reasoning_parser_from_the_model(tmp_path: Path, model_type, template, flag, expected) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    args = ServerArgs(reasoning_parser=flag)
    fmt = engine_setup.choose_chat_format(args, ModelFolder.read(tmp_path), SimpleNamespace(chat_template=template),
                                          None)
    assert fmt.reasoning_parser == expected and args.reasoning_parser == flag  # the args stay as parsed
    why = fmt.reasoning_parser_source
    assert why == "--reasoning-parser" if flag else why.startswith("the model" if expected else "none")
    assert fmt.harmony == (expected == "gpt-oss")
    assert fmt.extra_stop_tokens == (HARMONY_STOP_TOKENS if expected == "gpt-oss" else ())


def test_gpt_oss_stop_tokens_include_return_and_call() -> None:
    vocab = {"<|return|>": 200002, "<|call|>": 200012, "<|end|>": 200007}
    tok = SimpleNamespace(eos_token_id=199999, get_vocab=lambda: vocab)
    info = SimpleNamespace(eos_token_ids=[200002])
    assert engine_setup.stop_token_ids(info, tok, HARMONY_STOP_TOKENS) == [200002, 199999, 200012]
    assert engine_setup.stop_token_ids(info, tok) == [200002, 199999]


def test_the_parsers_a_model_can_choose_are_the_servers() -> None:
    # runtime/chat_format.py names what a model may choose; server/pipeline/parsing owns the names a flag may give.
    from tierlm.server.pipeline.parsing.reasoning import HARMONY, REASONING_PARSER_NAMES
    from tierlm.server.pipeline.parsing.tool_registry import TOOL_CALL_PARSERS

    assert HARMONY == HARMONY_PARSER
    assert set(DETECTED_REASONING_PARSERS) <= set(REASONING_PARSER_NAMES)
    assert set(DETECTED_TOOL_CALL_PARSERS) <= set(TOOL_CALL_PARSERS)
