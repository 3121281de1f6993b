"""Tokenizers: loading a model folder's tokenizer, and the byte-level tokenizer tierlm writes into the models
it builds itself (the demo model, synthetic benchmark models, test models)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tierlm.backends.model_source.errors import ModelSourceError

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)

# A few fixed English merges so common words are not all single bytes ("Ġ" is the byte-level space).
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġ", "a"),
    ("r", "e"), ("Ġ", "s"), ("e", "n"), ("a", "t"), ("o", "u"), ("Ġ", "w"), ("i", "s"), ("Ġ", "o"),
    ("in", "g"), ("Ġ", "i"), ("e", "d"), ("Ġ", "b"), ("n", "d"), ("Ġ", "c"), ("Ġa", "nd"), ("o", "r"),
]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_tokenizer(path: Path, trust_remote_code: bool = False, chat_template: str | None = None) -> Any:
    """The transformers tokenizer of a model folder (or of --tokenizer-path); ``chat_template``: the template text
    that replaces the model's own (--chat-template, resolved by chat_templates.resolve_chat_template)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelSourceError(f"could not load a tokenizer from {path}: {e}. Pass --tokenizer-path to a folder "
                               "with tokenizer.json / tokenizer_config.json.") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_byte_tokenizer():
    """Byte-level BPE: 5 special tokens, the 256 byte tokens, then the fixed merges. Any text round-trips."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())  # sorted: the set's order is not fixed
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for tok in byte_tokens:
        vocab[tok] = len(vocab)
    for left, right in MERGES:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def save_byte_tokenizer(out_dir: Path, **config: Any) -> int:
    """Write the byte-level tokenizer (tokenizer.json) and its tokenizer_config.json (ChatML template) into
    ``out_dir``; ``config`` overrides or adds tokenizer_config fields. Returns the vocabulary size."""
    tokenizer = build_byte_tokenizer()
    tokenizer.save(str(Path(out_dir) / "tokenizer.json"))
    fields = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "clean_up_tokenization_spaces": False,  # keeps decode(encode(text)) == text
              "chat_template": CHATML_TEMPLATE, **config}
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n",
                                                          encoding="utf-8")
    return tokenizer.get_vocab_size(with_added_tokens=True)
