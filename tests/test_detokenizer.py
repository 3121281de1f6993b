"""Incremental detokenization: deltas concatenate to the full decode, never show a partial character."""
from __future__ import annotations

import pytest

from conftest import STORIES_FIRST_40, STORIES_PROMPT, STORIES_TEXT
from tierlm.runtime.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was a little girl who loved to play",
    "hello world, hello tokenizer, hello again",
] * 20
MULTILINGUAL = "Café au lait, naïve 日本語のテキスト 🎉🚀 done. Ünïcödé ok!"


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t]) for t in ids] + [detok.flush()]


@pytest.fixture(scope="module")
def byte_bpe():
    """A small byte-level BPE trained on ASCII text, so every non-ASCII character is split over byte tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="module", params=["tokenizers", "transformers"])
def bpe(request, byte_bpe):
    """The same byte-level BPE as a bare tokenizers.Tokenizer and wrapped as a transformers tokenizer."""
    if request.param == "tokenizers":
        return byte_bpe
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_bpe, eos_token="<eos>")


def test_multibyte_characters_are_split_in_this_tokenizer(byte_bpe):
    ids = byte_bpe.encode(MULTILINGUAL).ids
    assert sum(REPLACEMENT in byte_bpe.decode([t]) for t in ids) >= 6, "the test needs characters split over tokens"


def encode(tok, text: str) -> list[int]:
    encoded = tok.encode(text)
    return encoded.ids if hasattr(encoded, "ids") else encoded


def test_byte_bpe_deltas_concatenate_to_the_full_decode(bpe):
    prompt, output = encode(bpe, "Translate: "), encode(bpe, MULTILINGUAL)
    deltas = stream(IncrementalDetokenizer(bpe, prompt), output)
    assert "".join(deltas) == bpe.decode(output)
    assert not any(REPLACEMENT in d for d in deltas)


def test_several_tokens_at_once(byte_bpe):
    ids = byte_bpe.encode(MULTILINGUAL).ids
    detok = IncrementalDetokenizer(byte_bpe, [])
    deltas = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert "".join(deltas) == MULTILINGUAL
    assert not any(REPLACEMENT in d for d in deltas)


def test_partial_character_is_held_until_flush(byte_bpe):
    ids = byte_bpe.encode("ok 🎉").ids
    cut = ids[:-1]  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(byte_bpe, [])
    shown = "".join(detok.add([t]) for t in cut)
    assert shown == "ok "
    remainder = detok.flush()
    assert remainder.endswith(REPLACEMENT)
    assert shown + remainder == byte_bpe.decode(cut)
    assert detok.flush() == ""


def test_special_tokens_are_skipped_or_kept(bpe):
    eos = bpe.token_to_id("<eos>") if hasattr(bpe, "token_to_id") else bpe.convert_tokens_to_ids("<eos>")
    words = encode(bpe, "hello world")
    skipped = "".join(stream(IncrementalDetokenizer(bpe, []), words[:1] + [eos] + words[1:] + [eos]))
    assert skipped == "hello world"
    kept = "".join(stream(IncrementalDetokenizer(bpe, [], skip_special_tokens=False), words + [eos]))
    assert kept == "hello world<eos>"


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, **kwargs)


def test_each_step_decodes_a_short_window(byte_bpe):
    counting = CountingTokenizer(byte_bpe)
    text = " ".join([MULTILINGUAL] * 20)
    ids = byte_bpe.encode(text).ids
    assert len(ids) > 500
    deltas = stream(IncrementalDetokenizer(counting, ids[:50]), ids)
    assert "".join(deltas) == text
    assert counting.longest <= 16


def test_a_run_of_skipped_special_tokens_keeps_the_window_short(byte_bpe):
    counting = CountingTokenizer(byte_bpe)
    eos = byte_bpe.token_to_id("<eos>")
    ids = encode(byte_bpe, "before") + [eos] * 200 + encode(byte_bpe, " after")
    assert "".join(stream(IncrementalDetokenizer(counting, []), ids)) == "before after"
    assert counting.longest <= 16


# --- the real SentencePiece-style Llama tokenizer of stories260K ---------------------------------------------

@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir))


def test_stories_continuation(stories_tokenizer):
    prompt = stories_tokenizer(STORIES_PROMPT)["input_ids"]
    deltas = stream(IncrementalDetokenizer(stories_tokenizer, prompt), STORIES_FIRST_40)
    assert "".join(deltas) == STORIES_TEXT
    assert deltas[1] == " there"


def test_stories_leading_space_is_kept(stories_tokenizer):
    prompt = stories_tokenizer(STORIES_PROMPT + ",")["input_ids"]
    output = STORIES_FIRST_40[1:]  # starts with "▁there"
    text = "".join(stream(IncrementalDetokenizer(stories_tokenizer, prompt), output))
    assert text == STORIES_TEXT[1:]
    assert text.startswith(" there")
    full = stories_tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert stories_tokenizer.decode(prompt, skip_special_tokens=True) + text == full


def test_stories_eos_adds_no_text(stories_tokenizer):
    prompt = stories_tokenizer(STORIES_PROMPT)["input_ids"]
    deltas = stream(IncrementalDetokenizer(stories_tokenizer, prompt), STORIES_FIRST_40[:5] + [2, 1])
    assert "".join(deltas) == ", there was a little"
