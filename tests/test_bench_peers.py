"""`tierlm bench peers`: one workload against tierlm and OpenAI-compatible peers, ratios from the same run.

The end-to-end test uses a second real tierlm server as the peer. Timings are never asserted; token counts,
which servers appear and how the ratios follow from the measured values are.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from tierlm.server.commands.bench import command as bench_cmd
from tierlm.server.commands.bench.openai_load import Endpoint, PeerError, PromptBuilder, stream_completion
from tierlm.server.commands.bench.server_process import BenchServer, free_port


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("spec, message", [
    ("vllm", "has no '='"),
    ("=http://127.0.0.1:8000", "has an empty name"),
    ("vllm=127.0.0.1:8000", "must start with http://"),
])
def test_against_spec_errors_are_argparse_errors(spec, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench_cmd.build_parser().parse_args(["peers", "--synthetic", "tiny", "--against", spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --against" in err and message in err


def test_against_name_given_twice_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench_cmd.build_parser().parse_args(["peers", "--synthetic", "tiny", "--against", "a=http://h:1",
                                             "--against", "a=http://h:2"])
    assert e.value.code == 2
    assert "'a' is given twice" in capsys.readouterr().err


def test_against_is_repeatable() -> None:
    ns = bench_cmd.build_parser().parse_args(["peers", "--synthetic", "tiny", "--against", "vllm=http://h:8000/",
                                              "--against", "sglang=http://h:30000"])
    assert ns.against == [("vllm", "http://h:8000/"), ("sglang", "http://h:30000")]
    assert (ns.prompt_tokens, ns.decode_tokens, ns.streams, ns.repeats) == (2016, 128, 8, 3)


def test_unreachable_peer_is_one_line_naming_the_url(tiny_llama, tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run([sys.executable, "-m", "tierlm.cli", "bench", "peers", "--model-path", str(tiny_llama),
                          "--against", f"vllm={url}", "--no-progress", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # no traceback
    assert lines[0].startswith("tierlm bench peers: cannot reach vllm (" + url + ")")
    assert "check that the server is running" in lines[0]


# ---------------------------------------------------------------- client pieces
def test_prompts_have_the_exact_token_count(tiny_llama) -> None:
    from tierlm.backends.model_source.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    b = PromptBuilder(tok.encode, np.random.default_rng(0))
    prefix = b.text(48)
    texts = [b.text(n) for n in (1, 2, 17, 64, 300)] + [b.text(64, head=prefix) for _ in range(3)]
    assert [len(tok.encode(t)) for t in texts] == [1, 2, 17, 64, 300, 64, 64, 64]
    assert all(t.startswith(prefix + " ") for t in texts[-3:]) and len(set(texts[-3:])) == 3


def _sse(events: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _complete_against(events: list[dict], max_tokens: int):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=_sse(events), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_completion(client, Endpoint("peer", "http://peer:1", "m"), "hello", max_tokens)

    return asyncio.run(go()), seen


def _choice(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def test_a_peer_that_stops_early_fails_clearly() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    with pytest.raises(PeerError, match=r"peer \(http://peer:1\) returned 3 completion tokens where 8 were asked"):
        _complete_against([_choice("a"), _choice("b"), _choice("c"), usage], 8)


def test_a_peer_without_stream_usage_fails_clearly() -> None:
    with pytest.raises(PeerError, match="streamed no usage"):
        _complete_against([_choice("a"), _choice("b")], 2)


def test_request_body_and_counts_from_usage() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    res, body = _complete_against([_choice("a"), _choice(""), _choice("b"), usage], 4)
    assert body == {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (5, 4, 2)
    assert res.first is not None and res.last >= res.first


# ---------------------------------------------------------------- end to end (two real servers)
@pytest.mark.slow
def test_peers_bench_measures_both_servers_with_the_asked_tokens(tiny_llama, tmp_path, capsys) -> None:
    with BenchServer(["--model-path", str(tiny_llama), "--page-size", "16"], log_dir=tmp_path, name="peer") as peer:
        peer.start()
        assert bench_cmd.main(["peers", "--model-path", str(tiny_llama), "--dtype", "float32",
                               "--against", f"other={peer.url}/v1",
                               "--prompt-tokens", "64", "--decode-tokens", "8", "--streams", "2", "--repeats", "1",
                               "--long-context-tokens", "200", "--json", "--no-progress"]) == 0
        rep = json.loads(capsys.readouterr().out)
        # --no-tierlm: only the peers (here the same server under two names), ratios to the first one
        assert bench_cmd.main(["peers", "--model-path", str(tiny_llama), "--no-tierlm", "--against", f"a={peer.url}",
                               "--against", f"b={peer.url}", "--prompt-tokens", "32", "--decode-tokens", "4",
                               "--streams", "1", "--repeats", "1", "--long-context-tokens", "0", "--json",
                               "--no-progress"]) == 0
        only = json.loads(capsys.readouterr().out)
    assert list(only["settings"]["servers"]) == ["a", "b"] and only["settings"]["reference"] == "a"
    assert only["environment"]["backend"] == {}  # no tierlm server of this run to describe
    for row in only["tables"][0]["rows"]:
        assert set(row["values"]) == {"a", "b"} and set(row["ratios"]) == {"b"}
    assert rep["benchmark"] == "peers" and rep["environment"]["backend"]["dtype"] == "float32"
    assert list(rep["settings"]["servers"]) == ["tierlm", "other"]
    assert rep["settings"]["servers"]["other"]["url"] == peer.url
    rows = {r["key"]: r for r in rep["tables"][0]["rows"]}
    assert list(rows) == ["cold_ttft_s", "warm_ttft_s", "decode_tps", "e2e_tps", "streams_tps", "long_decode_tps"]
    for key, tokens in (("cold_ttft_s", 1), ("warm_ttft_s", 1), ("decode_tps", 8), ("e2e_tps", 8),
                        ("streams_tps", 16), ("long_decode_tps", 8)):
        assert rows[key]["completion_tokens"] == {"tierlm": tokens, "other": tokens}
    for key, tokens in (("cold_ttft_s", 64), ("warm_ttft_s", 64), ("long_decode_tps", 200)):
        assert rows[key]["prompt_tokens"] == {"tierlm": tokens, "other": tokens}
    only_rows = {r["key"]: r for r in only["tables"][0]["rows"]}
    assert only_rows["long_decode_tps"]["values"] == {"a": None, "b": None}  # --long-context-tokens 0: no row
    assert all(48 <= n < 64 for n in rows["warm_ttft_s"]["cached_tokens"].values())  # the prefix was reused
    for key in ("cold_ttft_s", "warm_ttft_s", "e2e_tps", "streams_tps"):
        v = rows[key]["values"]
        assert v["tierlm"] > 0 and v["other"] > 0
    for row in rows.values():  # tierlm / peer, from the values of this run
        v = row["values"]
        expected = v["tierlm"] / v["other"] if v["tierlm"] is not None and v["other"] else None
        assert row["ratios"] == {"other": pytest.approx(expected) if expected is not None else None}
    assert rows["cold_ttft_s"]["better"].startswith("< 1") and rows["streams_tps"]["better"].startswith("> 1")
    raw = rep["raw"]
    assert set(raw) == {"tierlm", "other"} and len(raw["other"]["streams"][0]["requests"]) == 2
    # each round began after a wait for a quiet machine (at least the minimum), said in the notes
    assert all(len(raw[n]["quiet_waits"]) == 1 and raw[n]["quiet_waits"][0]["waited_s"] >= 1.5 for n in raw)
    assert any(n.startswith("before each server's round") for n in rep["tables"][0]["notes"])
    # issue #27's goals: one per (metric, peer) from this run's ratios, and the 1-stream bandwidth-bound share
    bound = rep["settings"]["bandwidth_bound_tps"]
    assert bound > 0 and any("bandwidth bound" in n for n in rep["tables"][0]["notes"])
    # the weights as tierlm's /server_info says one stream reads them (here float32: the checkpoint's count)
    assert any("weight_bytes_per_token" in n for n in rep["tables"][0]["notes"])
    from tierlm.server.commands.bench.peers import bytes_read_per_token

    assert bound == pytest.approx(rep["settings"]["read_bandwidth_bytes_per_s"]
                                  / bytes_read_per_token(tiny_llama, "float32"))
    targets = {t["name"]: t for t in rep["targets"]}
    r = rows["decode_tps"]["ratios"]["other"]
    assert targets["1-stream decode vs other"]["met"] == (r >= 1.2)
    assert targets["cold TTFT vs other"]["met"] == (rows["cold_ttft_s"]["ratios"]["other"] <= 0.8)
    share = rows["decode_tps"]["values"]["tierlm"] / bound
    assert targets["1-stream decode of the bandwidth bound"]["met"] == (share >= 0.6)
    assert only["targets"] == []  # without tierlm in the run there is nothing of tierlm's to judge


def test_each_round_visits_every_server_in_turn(monkeypatch) -> None:
    """A VM that runs fast or slow for minutes at a time must hit every server alike: round r of all servers
    comes before round r + 1 of any."""
    from tierlm.server.commands.bench import peers
    from tierlm.server.commands.bench.openai_load import Completion
    from tierlm.server.commands.bench.quiet_machine import QuietWait

    calls: list[tuple[str, str]] = []

    class FakeSession:
        def __init__(self, ep: Endpoint, max_connections: int) -> None:
            self.ep = ep

        async def __aenter__(self) -> "FakeSession":
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

        async def one(self, prompt: str, max_tokens: int) -> Completion:
            calls.append((self.ep.name, prompt))
            return Completion(sent=0.0, first=0.01, last=0.02, done=0.02 + max_tokens / 1000,
                              prompt_tokens=len(prompt), completion_tokens=max_tokens)

        async def concurrent(self, prompts, max_tokens):
            return [await self.one(p, max_tokens) for p in prompts], 0.05

    async def quiet() -> QuietWait:  # the wait for the last server's leftover work, recorded in order
        calls.append(("-", "quiet"))
        return QuietWait(0.0, 0.0, True)

    monkeypatch.setattr(peers, "Session", FakeSession)
    monkeypatch.setattr(peers, "wait_until_quiet", quiet)
    R = 3
    w = {"first": "f", "cold": [f"c{r}" for r in range(R)], "warm": [f"w{r}" for r in range(R + 1)],
         "single": [f"s{r}" for r in range(R)], "single_first": [f"t{r}" for r in range(R)],
         "long": [f"l{r}" for r in range(R)],
         "streams": [[f"x{r}a", f"x{r}b"] for r in range(R)]}
    ns = type("NS", (), {"decode_tokens": 8, "streams": 2, "repeats": R})()
    bar = type("Bar", (), {"update": lambda self: None, "set_description": lambda self, d: None})()
    eps = [Endpoint("a", "http://a", "m"), Endpoint("b", "http://b", "m")]
    results = peers.measure_all(eps, w, ns, bar)
    cold = [(name, p) for name, p in calls if p.startswith("c")]
    assert cold == [("a", "c0"), ("b", "c0"), ("a", "c1"), ("b", "c1"), ("a", "c2"), ("b", "c2")]
    a_calls = [p for name, p in calls if name == "a"]
    assert a_calls[:3] == ["f", "w0", "w1"]  # the first request off the clock; each round primes the warm prefix
    assert a_calls.count("w0") == R and a_calls.count("f") == 1
    # the long prompt: primed, then its 1-token and N-token requests both hit the primed context
    assert [p for name, p in calls if name == "b" and p.startswith("l")] == ["l0"] * 3 + ["l1"] * 3 + ["l2"] * 3
    for name in ("a", "b"):
        raw = results[name]["raw"]
        assert all(len(raw[k]) == R for k in ("cold", "warm", "single", "single_first", "long", "long_first",
                                               "streams"))
        assert results[name]["completion_tokens"]["single"] == 8
        assert raw["quiet_waits"] == [{"waited_s": 0.0, "busy_cores": 0.0, "quiet": True}] * R
    # every server's round, each round's first, starts after a wait for a quiet machine
    after_quiet = [calls[i + 1] for i, c in enumerate(calls) if c == ("-", "quiet")]
    assert after_quiet == [("a", "w0"), ("b", "w0")] * R


@pytest.mark.parametrize("tied", [False, True])
def test_the_bound_counts_the_weights_a_decode_step_reads(tmp_path, tied: bool) -> None:
    """An untied input embedding is left out of the bytes per token (one row of it is read); a tied one is the
    lm_head, read whole."""
    from safetensors.numpy import save_file

    from tierlm.server.commands.bench.peers import bytes_read_per_token

    vocab, hidden = 100, 16
    tensors = {"model.embed_tokens.weight": np.zeros((vocab, hidden), np.float32),
               "model.layers.0.mlp.down_proj.weight": np.zeros((hidden, 32), np.float32)}
    if not tied:
        tensors["lm_head.weight"] = np.zeros((vocab, hidden), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": vocab, "torch_dtype": "float32",
        "tie_word_embeddings": tied}))
    read = bytes_read_per_token(tmp_path, "bfloat16")
    assert read == (vocab * hidden + hidden * 32) * 2  # the lm_head (or the tied embedding) and the layer
