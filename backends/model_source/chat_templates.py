"""``--chat-template``: a jinja file, a template given inline, or a built-in name; resolved and compiled at startup.

Built-in templates (the names SGLang/vLLM users expect for the simple cases):

- ``chatml``: ``<|im_start|>{role}\\n{content}<|im_end|>`` per message (Qwen, many fine-tunes), no tools.
- ``chatml-tools`` (alias ``qwen2.5``): ChatML with Qwen2.5's / Hermes' tool format: the ``tools`` go into the
  system message inside ``<tools></tools>``, the assistant's calls are ``<tool_call>{"name", "arguments"}
  </tool_call>`` and tool results come back as ``<tool_response>`` in a user turn.
"""
from __future__ import annotations

import json
from pathlib import Path

from tierlm.backends.model_source.errors import ModelSourceError
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.model_source.tokenizer import CHATML_TEMPLATE

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message.get('tool_calls') or [] %}"
    "{%- set call = tool_call['function'] if tool_call.get('function') else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "chatml-tools": CHATML_TOOLS_TEMPLATE,
    "qwen2.5": CHATML_TOOLS_TEMPLATE,
}


def resolve_chat_template(value: str) -> tuple[str, str]:
    """(template text, where it came from) for a ``--chat-template`` value: a built-in name, a file, or the
    template itself (text with ``{{`` or ``{%``). Raises ModelSourceError with the fix; the text is compiled, so
    a jinja syntax error is reported here (with its line) rather than on the first chat request."""
    if value in BUILTIN_CHAT_TEMPLATES:
        text, source = BUILTIN_CHAT_TEMPLATES[value], f"built-in template '{value}'"
    elif "{{" in value or "{%" in value:
        text, source = value, "the template given inline"
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ModelSourceError(
                f"--chat-template {value!r} is neither a file nor a built-in template name; pass a jinja file "
                f"(e.g. --chat-template ./template.jinja) or one of: {', '.join(sorted(BUILTIN_CHAT_TEMPLATES))}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelSourceError(f"--chat-template: could not read {path}: {e}") from e
        if path.suffix == ".json":  # a tokenizer_config.json-style file holding the template
            text = _template_from_json(path, text)
        source = f"file {path}"
    check_chat_template(text, source)
    return text, source


def folder_chat_template(folder: ModelFolder) -> tuple[str | None, str | None]:
    """The chat template a tokenizer loaded from ``folder`` carries, read as transformers reads it
    (chat_template.jinja, else tokenizer_config.json's chat_template, its "default" entry when named ones), without
    loading the tokenizer: `tierlm doctor`'s view. (template, where from) or (None, None)."""
    jinja = folder.path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), "the model's tokenizer"
    try:
        template = json.loads((folder.path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None, None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return (template, "the model's tokenizer") if isinstance(template, str) and template else (None, None)


def _template_from_json(path: Path, text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ModelSourceError(f"--chat-template: {path} is not valid JSON: {e}") from e
    template = data.get("chat_template") if isinstance(data, dict) else None
    if not isinstance(template, str):
        raise ModelSourceError(f"--chat-template: {path} has no 'chat_template' string")
    return template


def check_chat_template(text: str, source: str) -> None:
    """Compile the template the way transformers will render it; a syntax error names the line."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # pragma: no cover - older transformers: plain jinja's parser says the same
        compile_template = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelSourceError(f"--chat-template ({source}) is not a valid jinja template: {e.message} "
                               f"(line {e.lineno})") from e
