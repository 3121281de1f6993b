"""Fill-in-the-middle: ``suffix`` on /v1/completions. The exact prompt ids each FIM family's tokenizer gives the engine,
the 400 on a model without FIM tokens, and (slow) a real server on both backends whose greedy output equals
transformers' greedy continuation of the assembled prompt."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from backends_under_test import BACKENDS
from e2e_server import ServerProcess, start_server
from fake_engine import FakeEngine
from http_helpers import LOCAL, assert_error
from model_factory import TOKENIZER_VOCAB, build_tiny_model, reference_greedy
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.app import create_app
from tierlm.server.pipeline.fim import STYLES, find_fim_tokens

QWEN = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
STARCODER = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
CODELLAMA = ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]
CODESTRAL = ["[PREFIX]", "[SUFFIX]"]
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


def fim_tokenizer(added: list[str], folder: Path | None = None) -> Any:
    """tierlm's byte-level test tokenizer with ``added`` as special tokens (ids 285, 286, ...), as a transformers
    tokenizer; saved into ``folder`` (tokenizer.json + tokenizer_config.json) when given."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tierlm.backends.model_source.tokenizer import CHATML_TEMPLATE, build_byte_tokenizer

    raw = build_byte_tokenizer()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  clean_up_tokenization_spaces=False)
    if folder is not None:
        raw.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE}))
    return tok


def plain(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def client_with(tokenizer: Any) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(ServerArgs(model_path="fake/model"))
    engine.tokenizer = tokenizer
    return TestClient(create_app(engine), base_url=LOCAL), engine


# ---------------------------------------------------------------- the prompt each family's engine receives


@pytest.mark.parametrize("markers", [QWEN, STARCODER, CODELLAMA])
def test_prefix_suffix_middle_order(markers: list[str]) -> None:
    tok = fim_tokenizer(markers)
    pre, suf, mid = (TOKENIZER_VOCAB + i for i in range(3))
    client, engine = client_with(tok)
    r = client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert engine.received[0].input_ids == [pre, *plain(tok, PREFIX), suf, *plain(tok, SUFFIX), mid]
    assert r.json()["usage"]["prompt_tokens"] == len(engine.received[0].input_ids)


def test_a_marker_spelled_in_the_code_stays_text() -> None:
    """Code about FIM (server/pipeline/fim.py itself) spells the markers: they must not open a second hole."""
    tok = fim_tokenizer(QWEN)
    pre, suf, mid = (TOKENIZER_VOCAB + i for i in range(3))
    client, engine = client_with(tok)
    code = 'MIDDLE = "<|fim_middle|>"\n'
    client.post("/v1/completions", json={"prompt": code, "suffix": "<|fim_suffix|>", "max_tokens": 1})
    ids = engine.received[0].input_ids
    assert ids.count(pre) == ids.count(suf) == ids.count(mid) == 1 and ids[-1] == mid
    assert tok.decode(ids[1:ids.index(suf)]) == code


def test_codellama_stops_at_its_end_of_middle_token() -> None:
    client, engine = client_with(fim_tokenizer(CODELLAMA))
    r = client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 3,
                                             "stop_token_ids": [7]})
    assert r.status_code == 200, r.text
    assert set(engine.received[0].sampling_params.stop_token_ids) == {7, TOKENIZER_VOCAB + 3}  # ▁<EOT>
    client, engine = client_with(fim_tokenizer(QWEN))  # Qwen ends the middle with its EOS: nothing added
    client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 3})
    assert engine.received[0].sampling_params.stop_token_ids == []


def test_codellama_infill_stops_at_its_end_of_middle_token_too() -> None:
    client, engine = client_with(fim_tokenizer(CODELLAMA))
    r = client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3})
    assert r.status_code == 200, r.text
    assert engine.received[0].sampling_params.stop_token_ids == [TOKENIZER_VOCAB + 3]  # ▁<EOT>


def test_codestral_puts_the_suffix_first_and_has_no_middle_marker() -> None:
    tok = fim_tokenizer(CODESTRAL)
    client, engine = client_with(tok)
    r = client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 3})
    assert r.status_code == 200, r.text
    prefix_id, suffix_id = TOKENIZER_VOCAB, TOKENIZER_VOCAB + 1
    assert engine.received[0].input_ids == [suffix_id, *plain(tok, SUFFIX), prefix_id, *plain(tok, PREFIX)]


def test_the_bos_a_tokenizer_adds_leads_the_prompt_and_its_eos_stays_out() -> None:
    from tokenizers import processors

    tok = fim_tokenizer(CODELLAMA)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                                  special_tokens=[("<s>", 1), ("</s>", 2)])
    assert tok.encode("x")[0] == 1
    client, engine = client_with(tok)
    client.post("/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 1})
    pre, suf, mid = (TOKENIZER_VOCAB + i for i in range(3))
    assert engine.received[0].input_ids == [1, pre, *plain(tok, "a"), suf, *plain(tok, "b"), mid]


def test_every_prompt_of_a_batch_and_an_id_prompt_get_the_suffix() -> None:
    tok = fim_tokenizer(QWEN)
    pre, suf, mid = (TOKENIZER_VOCAB + i for i in range(3))
    client, engine = client_with(tok)
    r = client.post("/v1/completions", json={"prompt": ["x = ", "y = "], "suffix": "\n", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert [q.input_ids for q in engine.received] == [[pre, *plain(tok, p), suf, *plain(tok, "\n"), mid]
                                                      for p in ("x = ", "y = ")]
    client.post("/v1/completions", json={"prompt": [40, 41], "suffix": "\n", "max_tokens": 2})
    assert engine.received[-1].input_ids == [pre, 40, 41, suf, *plain(tok, "\n"), mid]


def test_known_styles_are_found_from_the_vocabulary() -> None:
    deepseek = ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"]
    for markers, family in ((QWEN, "qwen-coder"), (STARCODER, "starcoder"), (CODELLAMA, "codellama"),
                            (CODESTRAL, "codestral"), (deepseek, "deepseek-coder")):
        found = find_fim_tokens(fim_tokenizer(markers))
        assert found is not None and found.style.family == family
    assert find_fim_tokens(fim_tokenizer(QWEN[:2])) is None  # a partial set is no set
    assert {s.family for s in STYLES} >= {"qwen-coder", "starcoder", "codellama", "codestral", "deepseek-coder"}


# ---------------------------------------------------------------- refusals


def test_a_model_without_fim_tokens_refuses_a_suffix_with_a_400() -> None:
    for tok in (fim_tokenizer([]), FakeEngine().tokenizer):
        client, engine = client_with(tok)
        err = assert_error(client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX}), 400,
                           param="suffix", contains="fill-in-the-middle")
        assert err["code"] == "fim_not_supported" and "<|fim_prefix|>" in err["message"]
        assert engine.received == []
        # an empty suffix (some clients always send one) stays a plain completion
        r = client.post("/v1/completions", json={"prompt": "ab", "suffix": "", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert engine.received[-1].input_ids == tok.encode("ab")


def test_echo_with_a_suffix_and_bad_suffix_text_are_400s() -> None:
    client, engine = client_with(fim_tokenizer(QWEN))
    assert_error(client.post("/v1/completions", json={"prompt": "a", "suffix": "b", "echo": True}), 400,
                 param="echo", contains="suffix")
    assert_error(client.post("/v1/completions", json={"prompt": "a", "suffix": 3}), 400, param="suffix")
    assert_error(client.post("/v1/completions", content='{"prompt": "a", "suffix": "\\ud800"}',
                             headers={"content-type": "application/json"}), 400, param="suffix")
    assert engine.received == []


# ---------------------------------------------------------------- /infill, llama.cpp's shape


def test_infill_prompt_with_other_files_as_repository_context() -> None:
    tok = fim_tokenizer([*QWEN, "<|repo_name|>", "<|file_sep|>"])
    pre, suf, mid, repo, sep = (TOKENIZER_VOCAB + i for i in range(5))
    client, engine = client_with(tok)
    r = client.post("/infill", json={"input_prefix": "x = ", "prompt": "ad", "input_suffix": "\n",
                                     "input_extra": [{"filename": "a.py", "text": "def add(): pass\n"}],
                                     "n_predict": 3, "cache_prompt": True, "samplers": ["top_k"]})
    assert r.status_code == 200, r.text
    assert engine.received[0].input_ids == [
        repo, *plain(tok, "myproject\n"), sep, *plain(tok, "a.py\n"), *plain(tok, "def add(): pass\n"),
        sep, *plain(tok, "filename\n"),
        pre, *plain(tok, "x = "), *plain(tok, "ad"), suf, *plain(tok, "\n"), mid]
    body = r.json()
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_predicted"] == 3
    assert body["tokens_evaluated"] == len(engine.received[0].input_ids)
    assert body["content"] == "".join(chr(t) for t in engine.received[0].input_ids[:3])  # the fake echoes


def test_infill_without_repository_markers_marks_snippets_in_text() -> None:
    tok = fim_tokenizer(STARCODER)
    pre, suf, mid = (TOKENIZER_VOCAB + i for i in range(3))
    client, engine = client_with(tok)
    client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 1,
                                 "input_extra": [{"text": "one"}, {"text": "two"}]})
    snippet = plain(tok, "\n\n--- snippet ---\n\n")
    assert engine.received[0].input_ids == [*snippet, *plain(tok, "one"), *snippet, *plain(tok, "two"),
                                            pre, *plain(tok, "a"), suf, *plain(tok, "b"), mid]


def test_infill_maps_llama_cpp_sampling_fields() -> None:
    client, engine = client_with(fim_tokenizer(QWEN))
    r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": -1, "seed": -1,
                                     "temperature": 0.5, "top_k": 40, "repeat_penalty": 1.1, "stop": ["\n"]})
    assert r.status_code == 200, r.text
    sp = engine.received[0].sampling_params
    assert sp.max_new_tokens == 2048 and sp.seed is None  # -1: what the context leaves (4096), at most 2048
    assert (sp.temperature, sp.top_k, sp.repetition_penalty, sp.stop) == (0.5, 40, 1.1, ["\n"])
    client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "max_tokens": 5, "seed": 7})
    assert engine.received[1].sampling_params.max_new_tokens == 5 and engine.received[1].sampling_params.seed == 7


def test_infill_stop_word_and_stream() -> None:
    client, engine = client_with(fim_tokenizer(QWEN))
    engine.script = "ab;cd"
    r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 9, "stop": [";"]})
    body = r.json()
    assert (body["content"], body["stop_type"], body["stopping_word"]) == ("ab", "word", ";")
    r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 9, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block.removeprefix("data: ")) for block in r.text.split("\n\n") if block.strip()]
    assert all(e == {"content": e["content"], "stop": False} for e in events[:-1])  # llama.cpp's pieces, no [DONE]
    assert "".join(e["content"] for e in events) == "ab;cd"
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "eos" and events[-1]["tokens_predicted"] == 5


def test_infill_on_a_model_without_fim_tokens_is_a_400() -> None:
    client, engine = client_with(fim_tokenizer([]))
    err = assert_error(client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"}), 400,
                       param="input_suffix", contains="fill-in-the-middle")
    assert err["code"] == "fim_not_supported"
    assert_error(client.post("/infill", json={"input_prefix": 1}), 400, param="input_prefix")
    assert engine.received == []


# ---------------------------------------------------------------- a real server on both backends


def build_fim_model(out_dir: Path) -> Path:
    """A seeded random tiny qwen2 whose vocabulary has Qwen2.5-Coder's three FIM tokens (ids 285-287)."""
    if (out_dir / "config.json").exists():
        return out_dir
    build_tiny_model("qwen2", out_dir, seed=29, vocab_size=TOKENIZER_VOCAB + len(QWEN))
    fim_tokenizer(QWEN, out_dir)  # replaces the demo tokenizer the model was written with
    return out_dir


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fim_model(tmp_path_factory.mktemp("fim_qwen2"))


@pytest.fixture(scope="module", params=BACKENDS)
def fim_server(request: Any, fim_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_server(["--model-path", str(fim_model), "--skip-warmup"],
                      env={"TIERLM_NO_PROGRESS": "1", "TIERLM_BACKEND": request.param},
                      log_dir=tmp_path_factory.mktemp(f"fim_{request.param}")) as s:
        yield s


@pytest.mark.slow
def test_suffix_completion_is_the_reference_greedy_of_the_fim_prompt(fim_server: ServerProcess,
                                                                      fim_model: Path) -> None:
    openai = pytest.importorskip("openai")
    tok = fim_tokenizer(QWEN)
    client = openai.OpenAI(base_url=fim_server.base_url, api_key="none", max_retries=0, timeout=120)
    ids = [TOKENIZER_VOCAB, *plain(tok, PREFIX), TOKENIZER_VOCAB + 1, *plain(tok, SUFFIX), TOKENIZER_VOCAB + 2]
    expected = tok.decode(reference_greedy(fim_model, ids, 12), skip_special_tokens=True)
    assert expected  # the comparison below is about text, not two empty strings
    r = client.completions.create(model="default", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    stream = client.completions.create(model="default", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    infill = httpx.post(f"{fim_server.url}/infill", timeout=120, json={
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12, "temperature": 0, "ignore_eos": True})
    assert infill.status_code == 200, infill.text
    assert infill.json()["content"] == expected and infill.json()["tokens_evaluated"] == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=2)
    assert e.value.response.json()["error"]["param"] == "echo"
