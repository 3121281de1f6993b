"""Fill-in-the-middle: the prompt a code model completes between a prefix (the request's prompt) and a suffix.

Each code-model family marks the hole with its own special tokens; a model's FIM style is found by looking for them
in its tokenizer's vocabulary. The prompt is assembled from token ids, as llama.cpp's /infill does: the prefix and
the suffix are tokenized on their own (no BOS/EOS added to either, markers in the text kept as text) and the markers
put between them as the exact ids the model was trained on, whatever the tokenizer would make of the joined text.
"""
from __future__ import annotations

from dataclasses import dataclass

from tierlm.runtime.errors import RequestError
from tierlm.runtime.tokenizer_protocol import Tokenizer
from tierlm.server.pipeline.text_fields import check_text


@dataclass(frozen=True)
class FimStyle:
    family: str
    prefix: str
    suffix: str
    middle: str | None  # None: the model starts the middle right after the last part (Codestral)
    suffix_first: bool = False  # SPM order: suffix, then prefix
    end: str | None = None  # a token that ends the middle, when it is not the model's EOS


# Checked in order; the first whose markers are all in the vocabulary wins.
STYLES = (
    FimStyle("qwen-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    FimStyle("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder(2), SantaCoder
    FimStyle("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimStyle("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", end="▁<EOT>"),  # CodeLlama's sentencepiece pieces
    FimStyle("codellama", "<PRE>", "<SUF>", "<MID>", end="<EOT>"),  # the same, converted with plain names
    FimStyle("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),  # Mistral: [SUFFIX] s [PREFIX] p
)


@dataclass(frozen=True)
class FimTokens:
    style: FimStyle
    prefix_id: int
    suffix_id: int
    middle_id: int | None
    end_id: int | None
    repo_id: int | None = None  # repository-level markers (Qwen2.5-Coder, StarCoder2): /infill's input_extra files
    file_sep_id: int | None = None


# llama.cpp's names for the repository-level markers, looked up the same way
REPO_NAMES = ("<|repo_name|>", "<repo_name>", "<reponame>")
FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>", "<filename>")


def find_fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The tokenizer's FIM markers, or None when it has none of the known sets."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    for style in STYLES:
        names = [style.prefix, style.suffix] + ([style.middle] if style.middle else [])
        if all(n in vocab for n in names):
            return FimTokens(style, vocab[style.prefix], vocab[style.suffix],
                             vocab[style.middle] if style.middle else None,
                             vocab.get(style.end) if style.end else None,
                             next((vocab[n] for n in REPO_NAMES if n in vocab), None),
                             next((vocab[n] for n in FILE_SEPARATORS if n in vocab), None))
    return None


def require_fim_tokens(tokenizer: Tokenizer, model: str, param: str = "suffix") -> FimTokens:
    """The markers, or the 400 a FIM request gets on a model that cannot fill in the middle."""
    found = find_fim_tokens(tokenizer)
    if found is None:
        known = ", ".join(sorted({f"{s.family} ({s.prefix} {s.suffix}{' ' + s.middle if s.middle else ''})"
                                  for s in STYLES}))
        hint = ". Remove 'suffix' for a plain completion" if param == "suffix" else ""
        raise RequestError(f"fill-in-the-middle needs a model trained for it; the tokenizer of {model} has none of "
                           f"the known FIM token sets: {known}{hint}", 400, param=param, code="fim_not_supported")
    return found


def encode_plain(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """Text as the model should read it: no BOS/EOS, and a marker spelled in the code (a file about FIM, this one)
    stays text instead of opening a second hole (llama.cpp's parse_special=false)."""
    check_text(text, param)
    if not text:
        return []
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer (remote code) without that option
        return list(tokenizer.encode(text, add_special_tokens=False))


def leading_specials(tokenizer: Tokenizer) -> list[int]:
    """What encode puts before any text ([BOS] for CodeLlama and DeepSeek-Coder, nothing for Qwen); an EOS it
    appends stays out, the model writes the middle next."""
    full = list(tokenizer.encode("a"))
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    start = next((i for i in range(len(full)) if full[i:i + len(bare)] == bare), 0)
    return full[:start]


def build_fim_prompt(tokenizer: Tokenizer, fim: FimTokens, prefix: str | list[int], suffix: str,
                     extra: list[int] | None = None) -> list[int]:
    """The ids of one FIM prompt: the tokenizer's leading special tokens (BOS where it adds one), ``extra`` context
    (other files, from ``extra_context``), then the markers around the parts in the family's order. ``prefix`` may
    already be token ids (an id prompt)."""
    lead = leading_specials(tokenizer) + list(extra or [])
    pre = list(prefix) if isinstance(prefix, list) else encode_plain(tokenizer, prefix, "prompt")
    suf = encode_plain(tokenizer, suffix, "suffix")
    if fim.style.suffix_first:
        ids = [fim.suffix_id, *suf, fim.prefix_id, *pre]
    else:
        ids = [fim.prefix_id, *pre, fim.suffix_id, *suf]
    if fim.middle_id is not None:
        ids.append(fim.middle_id)
    return lead + ids


def fim_prompts(tokenizer: Tokenizer, model: str, prompt: str | list[str] | list[int] | list[list[int]],
                suffix: str | None, echo: bool) -> tuple[list[tuple[list[int], str | None]], FimTokens] | None:
    """/v1/completions with ``suffix``: each prompt (the text before the hole) as a FIM prompt, with its text; None
    for a plain completion (no suffix, or '' on a model without FIM tokens, which older clients send)."""
    if suffix is None:
        return None
    fim = require_fim_tokens(tokenizer, model) if suffix else find_fim_tokens(tokenizer)
    if fim is None:
        return None
    check_text(suffix, "suffix")
    if echo:  # the prompt the model saw is not the text sent: nothing faithful to echo
        raise RequestError("echo cannot be combined with suffix (the model sees a fill-in-the-middle prompt, not the "
                           "prompt as sent); remove one of them", 400, param="echo")
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts: list = [prompt]
    elif not prompt:
        raise RequestError("prompt must not be empty", 400, param="prompt")
    else:
        prompts = list(prompt)
    return [(build_fim_prompt(tokenizer, fim, p, suffix), p if isinstance(p, str) else None) for p in prompts], fim


def extra_context(tokenizer: Tokenizer, fim: FimTokens, chunks: list[tuple[str, str]]) -> list[int]:
    """Other files as context before the hole, llama.cpp's /infill format: with repository markers, a repository
    header, each file as <file_sep>name\ntext and the current file's separator last; without them, each text after
    a '--- snippet ---' line. ``chunks``: (file name, text) pairs."""
    if not chunks:
        return []
    ids: list[int] = []
    if fim.repo_id is not None:
        ids += [fim.repo_id, *encode_plain(tokenizer, "myproject\n", "input_extra")]
    for i, (name, text) in enumerate(chunks):
        param = f"input_extra[{i}]"
        if fim.file_sep_id is not None:
            ids += [fim.file_sep_id, *encode_plain(tokenizer, name + "\n", param + ".filename")]
        else:
            ids += encode_plain(tokenizer, "\n\n--- snippet ---\n\n", param)
        ids += encode_plain(tokenizer, text, param + ".text")
    if fim.file_sep_id is not None:
        ids += [fim.file_sep_id, *encode_plain(tokenizer, "filename\n", "input_extra")]
    return ids
