"""`tierlm bench`: report structure, hit statistics read back from responses, flags on unconfirmed tiers.

Timings are never asserted (they are measurements, not behaviour). The end-to-end tests start real servers on
a tiny model with tiny sizes; the unit tests check the logic that decides what a row may claim.
"""
from __future__ import annotations

import json

import pytest

from tierlm.backends.model_source.synthetic import SPECS, ensure_synthetic_model, weight_shapes
from tierlm.server.commands.bench import command as bench_cmd
from tierlm.server.commands.bench import multiturn as bench_multiturn
from tierlm.server.commands.bench import prefix as bench_prefix
from tierlm.server.commands.bench import shared_l3
from tierlm.server.commands.bench import shared_docs
from tierlm.server.commands.bench import stats
from tierlm.server.commands.bench.report import Column, Report, Table, Target, render_table
from tierlm.server.commands.bench.server_process import RequestResult, parse_prometheus


def _result(device: int = 0, host: int = 0, storage: int = 0) -> RequestResult:
    return RequestResult(sent=0.0, first_token=0.1, done=0.2, prompt_tokens=80, completion_tokens=2,
                         cached={"device": device, "host": host, "storage": storage})


# ---------------------------------------------------------------- what a row may claim
def test_prefix_row_is_confirmed_only_by_its_own_tier() -> None:
    assert bench_prefix.confirm("L2 hit", _result(host=64), 64) == ("yes", True)
    text, ok = bench_prefix.confirm("L2 hit", _result(device=64), 64)  # served from L1: not an L2 hit
    assert not ok and text.startswith("NO: host 0 of 64") and "device 64" in text
    text, ok = bench_prefix.confirm("L3 hit", _result(host=16, storage=48), 64)
    assert not ok and text.startswith("PARTIAL: storage 48 of 64")
    assert bench_prefix.confirm("cold", _result(), 64) == ("yes", True)
    assert not bench_prefix.confirm("cold", _result(device=16), 64)[1]


def test_unconfirmed_prefix_row_is_not_credited() -> None:
    rows = [
        {"case": "cold", "repeat": 0, "ttft_s": 1.0, "completion_s": 1.1, "hit_device": 0, "hit_host": 0,
         "hit_storage": 0, "confirmed": "yes", "ok": True, "host_ram_bytes": 0, "l3_read_bytes": 0,
         "server_rss_bytes": 1},
        {"case": "L2 hit", "repeat": 0, "ttft_s": 0.01, "completion_s": 0.1, "hit_device": 64, "hit_host": 0,
         "hit_storage": 0, "confirmed": "NO: host 0 of 64 (device 64)", "ok": False, "host_ram_bytes": 0,
         "l3_read_bytes": 0, "server_rss_bytes": 1},
    ]
    summary = bench_prefix.summarize(rows)
    assert [r["case"] for r in summary] == ["cold", "L2 hit"]
    assert summary[1]["ttft_vs_cold"] == pytest.approx(0.01)
    (target,) = bench_prefix.targets(summary)
    assert target.met is None and "do not confirm" in target.note  # fast, but not a win


def test_multiturn_mode_must_hit_the_tier_it_adds() -> None:
    s = {"mode": "hicache-l2+l3", "hit_tokens": {"device": 10, "host": 5, "storage": 0}, "ttft_vs_radix": 0.1}
    s["confirmed"] = bench_multiturn.confirm(s)
    assert s["confirmed"].startswith("NO")
    assert bench_multiturn.targets([s])[0].met is None
    s2 = {"mode": "hicache-l2", "hit_tokens": {"device": 0, "host": 5, "storage": 0}, "ttft_vs_radix": 0.5}
    s2["confirmed"] = bench_multiturn.confirm(s2)
    assert bench_multiturn.targets([s2])[0].met is False


def test_percentile_median_and_prometheus_parsing() -> None:
    assert stats.percentile([5, 1, 4, 2, 3], 90) == 5
    assert stats.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9
    assert stats.median([3, 1, 2, 10]) == 2.5
    text = ('# HELP x\ntierlm_cache_hit_tokens_total{model_name="m",tier="host"} 32.0\n'
            'tierlm_kv_pages_capacity{model_name="m"} 7.0\n')
    assert parse_prometheus(text) == {'tierlm_cache_hit_tokens_total{tier="host"}': 32.0,
                                      "tierlm_kv_pages_capacity": 7.0}


def test_report_text_and_json() -> None:
    table = Table("t", [Column("a", "A"), Column("t", "time ms", "ms"), Column("r", "ratio", "x")],
                  [{"a": "cold", "t": 0.5, "r": 1.0}, {"a": "hit", "t": None, "r": 0.25}], ["a note"])
    text = render_table(table)
    assert "500.0" in text and "0.250x" in text and "note: a note" in text
    rep = Report("prefix", "tierlm bench prefix", {"machine": {"cpu": "x"}}, {"k": 1}, [table],
                 [Target("L1", "<= 2%", "1%", True), Target("L2", "<= 3%", "9%", None, "unconfirmed")])
    out = rep.render()
    assert "-> met" in out and "NOT CREDITED (unconfirmed)" in out
    assert json.loads(rep.to_json())["tables"][0]["rows"][1]["r"] == 0.25


# ---------------------------------------------------------------- synthetic models
def test_synthetic_qwen_has_the_published_parameter_count() -> None:
    spec = dict(SPECS["qwen2.5-0.5b"])
    from transformers import AutoConfig

    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    shapes = weight_shapes(config)
    total = sum(int(__import__("math").prod(s)) for s in shapes.values())
    assert total == 494_032_768  # Qwen2.5-0.5B: 0.49 B parameters, embeddings tied
    assert "lm_head.weight" not in shapes and shapes["model.embed_tokens.weight"] == (151936, 896)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (128, 896)  # 2 KV heads x 64


def test_synthetic_build_is_seeded_and_loads(tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    a = ensure_synthetic_model("tiny", cache_root=tmp_path / "a")
    b = ensure_synthetic_model("tiny", cache_root=tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_synthetic_model("tiny", cache_root=tmp_path / "a") == a  # cached: not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    model, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, SPECS["tiny"]["vocab_size"])


def test_bench_needs_a_model(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench_cmd.main(["prefix"])
    assert e.value.code == 2
    assert "--synthetic" in capsys.readouterr().err


def test_bench_names_a_missing_model_without_a_traceback(tmp_path, capsys) -> None:
    assert bench_cmd.main(["prefix", "--model-path", str(tmp_path / "missing")]) == 1
    assert "no such folder" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end (real servers)
def _run_json(capsys, argv: list[str]) -> dict:
    assert bench_cmd.main([*argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_prefix_bench_reads_hits_per_tier(tiny_llama, capsys) -> None:
    rep = _run_json(capsys, ["prefix", "--model-path", str(tiny_llama), "--dtype", "float32", "--prefix-tokens", "64",
                             "--suffix-tokens", "8", "--max-new-tokens", "2",
                             "--server-arg=--hicache-storage-prefetch-policy=wait_complete",
                             "--l3-other-instance", "on" if shared_l3.unavailable() is None else "off"])
    assert rep["benchmark"] == "prefix"
    assert {"machine", "backend", "threads", "versions", "model"} <= set(rep["environment"])
    assert rep["environment"]["backend"]["dtype"] == "float32"
    rows = {r["case"]: r for r in rep["tables"][0]["rows"]}
    other = shared_l3.unavailable() is None
    assert list(rows) == ["cold", "L1 hit", "L2 hit", "L3 hit"] + ["L3 other instance"] * other
    if other:  # server B read every prefix page that server A computed, through the shared Mooncake store
        assert rows["L3 other instance"]["hit_storage"] == 64 and rows["L3 other instance"]["hit_host"] == 0
        assert rows["L3 other instance"]["l3_read_bytes"] > 0
        other_raw = [r for r in rep["raw"]["requests"] if r["case"] == "L3 other instance"]
        assert other_raw and all(r["l3_transport"] == shared_l3.transport() for r in other_raw)  # B's own report
    assert (rows["cold"]["hit_device"], rows["cold"]["hit_host"], rows["cold"]["hit_storage"]) == (0, 0, 0)
    assert rows["L1 hit"]["hit_device"] == 64
    assert rows["L2 hit"]["hit_host"] == 64 and rows["L2 hit"]["hit_device"] == 0
    assert rows["L3 hit"]["hit_storage"] == 64 and rows["L3 hit"]["l3_read_bytes"] > 0
    assert all(r["confirmed"] == "yes" for r in rows.values())
    assert rows["cold"]["ttft_vs_cold"] == 1.0
    assert [t["name"] for t in rep["targets"]] == ["L1 hit TTFT", "L2 hit TTFT", "L3 hit TTFT"] + [
        "L3 other instance TTFT"] * other + ["L3 hit TTFT vs L2 hit", "L3 extra read rate"]
    assert rows["L3 hit"]["l3_read_mib_s"] > 0 and rows["L2 hit"]["l3_read_mib_s"] is None
    raw = rep["raw"]["requests"]
    assert all(r["prompt_tokens"] == 72 and r["completion_tokens"] == 2 for r in raw)


@pytest.mark.slow
def test_multiturn_bench_hit_rates_come_from_responses(tiny_llama, capsys) -> None:
    rep = _run_json(capsys, ["multiturn", "--model-path", str(tiny_llama), "--clients", "3", "--rounds", "2",
                             "--system-tokens", "16", "--context-tokens", "64", "--turn-tokens", "16",
                             "--answer-tokens", "2", "--modes", "radix,hicache-l2"])
    rows = {r["mode"]: r for r in rep["tables"][0]["rows"]}
    assert list(rows) == ["radix", "hicache-l2"]
    for mode, row in rows.items():
        reqs = rep["raw"][mode]
        assert len(reqs) == 6 and row["requests"] == 6
        prompt = sum(r["prompt_tokens"] for r in reqs)
        for tier, col in (("device", "hit_device"), ("host", "hit_host"), ("storage", "hit_storage")):
            assert row[col] == pytest.approx(sum(r["cached"][tier] for r in reqs) / prompt)
    # the host tier holds every conversation: round 2 reuses round 1's pages from L1 or L2
    assert all(r["cached"]["device"] + r["cached"]["host"] >= 80 for r in rep["raw"]["hicache-l2"] if r["round"] == 1)
    assert rows["radix"]["hit_host"] == 0 and rows["radix"]["ttft_vs_radix"] == 1.0
    assert rep["targets"] and rep["targets"][0]["name"] == "hicache-l2 mean TTFT"


@pytest.mark.slow
def test_decode_bench_rows(tiny_llama, capsys) -> None:
    rep = _run_json(capsys, ["decode", "--model-path", str(tiny_llama), "--prompt-tokens", "16",
                             "--new-tokens", "4", "--streams", "2", "--stagger-ms", "10", "--bandwidth-mib", "16"])
    rows = rep["tables"][0]["rows"]
    engines = [(r["engine"].split(" (")[0], r["shape"]) for r in rows]
    assert engines[:4] == [("tierlm server", "1 stream"), ("tierlm server", "2 streams, 10 ms apart"),
                           ("transformers generate", "batch 1"), ("transformers generate", "batch 2")]
    assert engines[-1][0].startswith("ceiling")
    assert rows[0]["tokens"] == 4 and rows[1]["tokens"] == 8  # exactly the requested tokens came back
    assert rep["settings"]["weight_bytes"] > 0 and rep["settings"]["memory_bandwidth_bytes_per_s"] > 0
    # A target is reported exactly when both of its rates were measured (a loaded machine may deliver all four
    # tokens in one event, leaving no decode interval to time).
    hf1 = rows[2]
    expected = {name for name, ours, theirs in (("decode at batch 1", rows[0]["decode_tps"], hf1["decode_tps"]),
                                                 ("aggregate with 2 streams", rows[1]["aggregate_tps"],
                                                  hf1["aggregate_tps"])) if ours and theirs}
    assert {t["name"] for t in rep["targets"]} == expected


def test_multiturn_l1_runs_the_concurrent_requests_but_not_the_working_set() -> None:
    ns = bench_cmd.build_parser().parse_args(["multiturn", "--synthetic", "tiny", "--clients", "8",
                                              "--concurrency", "2", "--l1-fraction", "0.1"])
    sizes = bench_multiturn.plan_sizes(ns, 16)
    assert sizes["l1"] >= 2 * sizes["longest"]  # two requests fit side by side
    assert sizes["l1"] < sizes["working_set"]  # ...but not every conversation
    assert sizes["l2_ratio"] * sizes["l1"] >= sizes["working_set"]  # the L2 mode's host tier holds them all


# ---------------------------------------------------------------- spec (NGRAM speculative decoding)
def test_spec_rows_flag_different_outputs_and_random_copy_rows() -> None:
    from tierlm.server.commands.bench import spec as bench_spec

    assert bench_spec.copy_prompt([5, 6, 7, 8], 2, lead=[1]) == [1, 5, 6, 7, 8, 5, 6]
    assert bench_spec.ngram_copied([1, 2, 3, 4, 5], [4, 5, 9], n=2) == pytest.approx(1 / 3)  # (4,5) is in the prompt
    a = [RequestResult(sent=0.0, output_ids=[1, 2, 3]), RequestResult(sent=0.0, output_ids=[4, 5])]
    b = [RequestResult(sent=0.0, output_ids=[1, 2, 3]), RequestResult(sent=0.0, output_ids=[4, 6])]
    assert bench_spec.compare_outputs(a, a) == ("yes (2/2)", True)
    text, ok = bench_spec.compare_outputs(a, b)
    assert not ok and "prompt 1 at token 1" in text
    row = {"workload": "copy-text", "speedup": 2.5, "plain_tps": 10.0, "ngram_tps": 25.0, "accept_length": 3.0,
           "same_ok": True, "spec_reported": True}
    assert bench_spec.spec_targets([row], random_weights=False)[0].met is True
    assert bench_spec.spec_targets([row], random_weights=True)[0].met is None  # random weights do not copy
    assert bench_spec.spec_targets([{**row, "same_ok": False}], random_weights=False)[0].met is None
    slow = {**row, "workload": "ordinary", "speedup": 0.9}
    assert bench_spec.spec_targets([slow], random_weights=False)[0].met is False


@pytest.mark.slow
def test_spec_bench_runs_both_servers_with_the_same_output(tiny_llama, capsys) -> None:
    # float32: NGRAM's greedy output equals plain decode's exactly only where a (1+k)-token verify forward rounds
    # like a 1-token one (in bf16 the two paths can pick a different near-tie token)
    rep = _run_json(capsys, ["spec", "--model-path", str(tiny_llama), "--dtype", "float32", "--new-tokens", "8",
                             "--prompts", "2",
                             "--passage-tokens", "16", "--copy-tokens", "8", "--verify-context", "16",
                             "--verify-runs", "2"])
    assert rep["benchmark"] == "spec"
    spec_table, verify_table = rep["tables"]
    rows = {r["workload"]: r for r in spec_table["rows"]}
    assert list(rows) == ["ordinary", "copy-text", "copy-self"]  # ordinary first: the n-gram store is empty
    for r in rows.values():
        assert r["same_output"] == "yes (2/2)" and r["same_ok"]  # greedy NGRAM output == plain output
        assert r["spec_reported"] and r["verify_ct"] > 0 and r["accept_length"] >= 1.0
        assert 0.0 <= r["accept_rate"] <= 1.0
    outs = rep["raw"]["outputs"]
    assert outs["plain"] == outs["ngram"]
    assert all(len(o) == 8 for run in outs["plain"]["copy-self"] for o in run)
    prompts = rep["raw"]["prompts"]["copy-text"]
    # (BOS,) the passage, then its first 8 tokens again
    assert all(p[-8:] in (p[0:8], p[1:9]) and len(p) > 16 for p in prompts)
    assert rep["settings"]["speculative"] is not None  # /server_info of the NGRAM server
    assert [r["k"] for r in verify_table["rows"]] == list(range(9))
    assert verify_table["rows"][0]["vs_decode"] == 1.0
    assert [t["name"] for t in rep["targets"]] == ["ordinary decode tok/s with NGRAM",
                                                   "copy-text decode tok/s with NGRAM",
                                                   "copy-self decode tok/s with NGRAM",
                                                   "verify forward of 1 + 4 tokens"]


def test_shared_docs_workload_and_eviction_policy_list() -> None:
    ns = bench_cmd.build_parser().parse_args(["multiturn", "--synthetic", "tiny", "--workload", "shared-docs",
                                              "--docs", "4", "--doc-tokens", "64", "--requests", "12",
                                              "--radix-eviction-policies", "lru,lfu"])
    sizes = shared_docs.plan_sizes(ns, 16, bench_multiturn.running_slots(ns))
    assert sizes["l1"] >= 2 * sizes["longest"] and sizes["l2_ratio"] * sizes["l1"] < sizes["working_set"]
    p = shared_docs.prompts(ns, 0, 1000)
    assert p["contexts"][0] == p["contexts"][4] != p["contexts"][1] and len(p["turns"]) == 12
    uses = shared_docs.document_uses([(c, 0, None) for c in range(12)], 4)
    assert [r for _, r, _ in uses] == [0] * 4 + [1] * 4 + [2] * 4
    assert bench_multiturn._policy_list(ns.radix_eviction_policies, ("lru", "lfu"), "x") == ["lru", "lfu"]
    with pytest.raises(SystemExit):
        bench_multiturn._policy_list("lru,mru", ("lru", "lfu"), "radix eviction policy")
