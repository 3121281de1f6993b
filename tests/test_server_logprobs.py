"""Logprob fields of /v1/completions, /v1/chat/completions and /generate against a real Engine (stories260K, both
backends, in-process app): the shapes OpenAI / SGLang clients (lm-eval's local-completions) read, and numbers equal
to transformers' float32 log-softmax within 1e-4."""
from __future__ import annotations

import numpy as np
import pytest
from backends_under_test import BACKENDS
from engine_harness import start_engine
from fastapi.testclient import TestClient
from http_helpers import LOCAL, sse_events
from model_factory import reference_log_softmax

from tierlm.server.api.openai.protocol import ChatMessage
from tierlm.server.app import create_app
from tierlm.server.pipeline.tokenization import apply_chat_template

TOL = 1e-4
PAGE = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def reference(stories_dir):
    from transformers import AutoTokenizer

    def token_logprobs(ids: list[int]) -> np.ndarray:
        """logprob of ids[p] given ids[:p], p = 1 .. len(ids) - 1."""
        return reference_log_softmax(stories_dir, ids)[np.arange(len(ids) - 1), ids[1:]]

    return AutoTokenizer.from_pretrained(stories_dir), token_logprobs


@pytest.fixture(scope="module", params=BACKENDS)
def client(request, stories_dir):
    engine = start_engine(stories_dir, request.param, page_size=PAGE, chunked_prefill_size=16, max_total_tokens=2048)
    engine.tokenizer.chat_template = CHAT_TEMPLATE  # stories260K has none
    try:
        with TestClient(create_app(engine), base_url=LOCAL) as c:
            yield c
    finally:
        engine.shutdown()


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": "default", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(client, reference, max_tokens):
    """lm-eval sends token ids, echo, logprobs 1 and max_tokens 1 (0 works too); it sums token_logprobs[ctxlen:]
    (without the generated last one) and checks each against max(top_logprobs)."""
    tok, ref = reference
    context, continuation = tok.encode("Once upon a time, there was"), tok.encode(" a little girl named Lily.",
                                                                                 add_special_tokens=False)
    ids = context + continuation
    choice = complete(client, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1)["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], ref(ids), atol=TOL)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) == 1 and max(top.values()) >= value - 1e-6
    if max_tokens:  # greedy: the generated token is its own top-1, bit for bit
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        assert choice["text"].startswith(tok.decode(ids))


def test_completion_text_echo_offsets_and_stream(client, reference):
    tok, ref = reference
    prompt = "One day, a big dog saw a ball"
    body = dict(prompt=prompt, max_tokens=6, logprobs=3, echo=True)
    whole = complete(client, **body)["choices"][0]
    lp = whole["logprobs"]
    n_prompt = len(tok.encode(prompt))
    assert len(lp["tokens"]) == n_prompt + 6
    gen_offsets = lp["text_offset"][n_prompt:]
    assert gen_offsets[0] == len(prompt) and whole["text"].startswith(prompt)
    # the generated pieces rebuild the generated text at their offsets
    text = whole["text"]
    for tok_str, off in zip(lp["tokens"][n_prompt:], gen_offsets):
        assert text[off:off + len(tok_str)] == tok_str
    for top in lp["top_logprobs"][1:]:
        assert list(top.values()) == sorted(top.values(), reverse=True) and len(top) <= 3
    r = client.post("/v1/completions", json={"model": "default", "temperature": 0, "stream": True, **body})
    chunks = [e["choices"][0] for e in sse_events(r) if e != "[DONE]" and e["choices"]]
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for k in merged:
            merged[k] += (c["logprobs"] or {}).get(k, [])
    assert "".join(c["text"] for c in chunks) == text
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    np.testing.assert_allclose(merged["token_logprobs"][1:], lp["token_logprobs"][1:], atol=1e-6)


def test_chat_logprobs_shape_and_stream(client, reference):
    tok, ref = reference
    body = {"model": "default", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode("utf-8"))
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
    prompt_ids = apply_chat_template(client.app.state.engine.tokenizer, [ChatMessage(**m) for m in body["messages"]])
    gen = client.post("/generate", json={"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 6,
                                                                                      "temperature": 0}}).json()
    out_ids = gen["output_ids"]
    np.testing.assert_allclose([e["logprob"] for e in content], ref(prompt_ids + out_ids)[len(prompt_ids) - 1:],
                               atol=TOL)
    stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [e for e in sse_events(stream) if e != "[DONE]" and e["choices"]]
    streamed = [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["content"]]
    assert [x["token"] for x in streamed] == [x["token"] for x in content]
    np.testing.assert_allclose([x["logprob"] for x in streamed], [x["logprob"] for x in content], atol=1e-6)
    no_lp = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert no_lp["choices"][0]["logprobs"] is None
    assert no_lp["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_generate_meta_info_and_honest_cached_tokens(client, reference):
    tok, ref = reference
    ids = tok.encode("Tom and Sue went to the park. They played on the swings.")
    start = 9
    warm = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert warm.status_code == 200
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": start, "return_text_in_logprobs": True}
    meta = client.post("/generate", json=body).json()["meta_info"]
    assert meta["cached_tokens"] == (start // PAGE) * PAGE  # the prompt is cached, but only this much is reusable
    inp, out = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inp] == ids[start:] and inp[0][0] is None
    np.testing.assert_allclose([e[0] for e in inp[1:]], ref(ids)[start:], atol=TOL)
    assert len(out) == 4 and all(isinstance(e[2], str) for e in inp + out)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(inp)
    assert all(len(t) == 2 and t[0][0] >= t[1][0] for t in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"])
    no_start = client.post("/generate", json={**body, "logprob_start_len": -1, "return_text_in_logprobs": False})
    meta = no_start.json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["cached_tokens"] == (len(ids) - 1) // PAGE * PAGE
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    # streaming: cumulative, the last event holds everything
    events = [e for e in sse_events(client.post("/generate", json={**body, "stream": True})) if e != "[DONE]"]
    last = events[-1]["meta_info"]
    assert [e[1] for e in last["output_token_logprobs"]] == events[-1]["output_ids"]
    assert [e[1] for e in last["input_token_logprobs"]] == ids[start:]
