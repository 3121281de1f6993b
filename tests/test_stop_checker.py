"""Stop rules: token ids, eos, length, and stop strings across streamed deltas (OpenAI semantics)."""
from __future__ import annotations

import pytest

from tierlm.runtime.stop_checker import StopChecker


def feed(checker: StopChecker, deltas: list[str]) -> tuple[list[str], bool, str | None]:
    shown, finished, matched = [], False, None
    for delta in deltas:
        text, finished, matched = checker.process_text(delta)
        shown.append(text)
        if finished:
            break
    return shown, finished, matched


def test_no_stop_strings_pass_text_through():
    checker = StopChecker()
    assert feed(checker, ["Hello", " world"]) == (["Hello", " world"], False, None)
    assert checker.flush() == ""


def test_stop_string_inside_one_delta_is_cut_before_it():
    checker = StopChecker(stop_strings=["END"])
    shown, finished, matched = feed(checker, ["abc END xyz"])
    assert (shown, finished, matched) == (["abc "], True, "END")
    assert checker.finished and checker.matched_stop == "END"


def test_stop_string_split_across_deltas_is_never_shown():
    checker = StopChecker(stop_strings=["\n\nUser:"])
    deltas = ["Sure", ".\n", "\nUs", "er", ":", " more"]
    shown, finished, matched = feed(checker, deltas)
    assert finished and matched == "\n\nUser:"
    assert "".join(shown) == "Sure."
    assert all("\n" not in s for s in shown), "a part of the stop string was streamed"


def test_held_back_text_is_released_when_it_does_not_become_a_stop():
    checker = StopChecker(stop_strings=["STOP"])
    shown, finished, _ = feed(checker, ["go ST", "O", "RY"])
    assert not finished
    assert shown == ["go ", "", "STORY"]
    shown, finished, _ = feed(checker, ["end ST"])
    assert shown == ["end "] and not finished
    assert checker.flush() == "ST"
    assert checker.flush() == ""


def test_held_back_suffix_uses_the_longest_possible_start():
    checker = StopChecker(stop_strings=["abab"])
    assert checker.process_text("xaba") == ("x", False, None)  # "aba" may still become "abab"
    assert checker.process_text("b") == ("", True, "abab")


def test_earliest_stop_string_wins():
    checker = StopChecker(stop_strings=["world", "lo"])
    assert checker.process_text("hello world") == ("hel", True, "lo")
    checker = StopChecker(stop_strings=["bcd", "b"])
    assert checker.process_text("abcd") == ("a", True, "b")


def test_after_a_stop_string_nothing_more_is_shown():
    checker = StopChecker(stop_strings=["."])
    assert checker.process_text("One. Two") == ("One", True, ".")
    assert checker.process_text(" three") == ("", True, ".")
    assert checker.flush() == ""


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_and_stop_token_ids(ignore_eos):
    checker = StopChecker(stop_token_ids=[7], eos_token_ids=[2, 1], ignore_eos=ignore_eos, max_new_tokens=100)
    assert checker.check_token(5, 1) == (None, None)
    assert checker.check_token(7, 2) == ("stop", 7)
    expected_eos = (None, None) if ignore_eos else ("stop", 1)
    assert checker.check_token(1, 3) == expected_eos


def test_stop_token_id_still_stops_under_ignore_eos_when_it_is_also_an_eos():
    checker = StopChecker(stop_token_ids=[2], eos_token_ids=[2], ignore_eos=True)
    assert checker.check_token(2, 1) == ("stop", 2)


def test_length():
    checker = StopChecker(eos_token_ids=[2], max_new_tokens=3)
    assert checker.check_token(9, 2) == (None, None)
    assert checker.check_token(9, 3) == ("length", None)
    assert checker.check_token(2, 3) == ("stop", 2)  # a stop token on the last allowed token is a stop
    assert StopChecker().check_token(9, 10_000) == (None, None)


def test_finish_releases_detokenizer_remainder_and_held_text():
    checker = StopChecker(stop_strings=["<|end|>"])
    assert checker.process_text("answer <|e") == ("answer ", False, None)
    assert checker.finish("x") == "<|ex"


def test_finish_can_still_find_a_stop_string():
    checker = StopChecker(stop_strings=["<|end|>"])
    assert checker.process_text("answer <|en") == ("answer ", False, None)
    assert checker.finish("d|>") == ""  # the held "<|en" was the start of the stop string
    assert checker.finished and checker.matched_stop == "<|end|>"


def test_documented_engine_loop_with_a_real_tokenizer(stories_dir):
    """The per-token loop in stop_checker's docstring, on stories260K: a stop string spread over tokens."""
    from transformers import AutoTokenizer

    from conftest import STORIES_FIRST_40, STORIES_PROMPT
    from tierlm.runtime.detokenizer import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    detok = IncrementalDetokenizer(tokenizer, tokenizer(STORIES_PROMPT)["input_ids"])
    stop = StopChecker(stop_strings=["girl named"], eos_token_ids=[2, 1], max_new_tokens=40)
    shown, reason, matched = [], None, None
    for n, token in enumerate(STORIES_FIRST_40, start=1):
        reason, matched = stop.check_token(token, n)
        text, done = "", False
        if reason != "stop":
            text, done, stop_str = stop.process_text(detok.add([token]))
            if done:
                reason, matched = "stop", stop_str
        if reason is not None and not done:
            text += stop.finish(detok.flush())
        shown.append(text)
        if reason is not None:
            break
    assert (reason, matched) == ("stop", "girl named")
    assert "".join(shown) == ", there was a little "
