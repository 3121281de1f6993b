"""`tierlm bench decode --weight-formats` (server/commands/bench/weight_formats.py) and the bench's --quantization /
--torchao-config flags: entries parsed with the reason for a bad one, one server per format with its weight format
and bytes read back, agreement with the unquantized model of the same dtype. Timings are never asserted."""
from __future__ import annotations

import json

import pytest

from tierlm.server.commands.bench import command as bench_cmd
from tierlm.server.commands.bench.weight_formats import nominal_bytes, parse_entries


def test_entries_name_a_dtype_and_an_optional_torchao_config():
    assert parse_entries("float32, bfloat16:int4wo-128") == [("float32", None), ("bfloat16", "int4wo-128")]
    assert [nominal_bytes(*e) for e in parse_entries("float32,bfloat16,bfloat16:int8wo,float32:int4wo-32")] == \
        [4, 2, 1, 0.5]
    with pytest.raises(SystemExit, match="start each entry with a dtype"):
        parse_entries("int8wo,float32")
    with pytest.raises(SystemExit, match="at least two"):
        parse_entries("float32")


def test_quantization_flags_reach_every_server():
    ns = bench_cmd.build_parser().parse_args(["peers", "--torchao-config", "int8wo"])
    assert bench_cmd._quant_flags(ns) == ["--torchao-config", "int8wo"]
    ns = bench_cmd.build_parser().parse_args(["decode", "--quantization", "w8a8_int8"])
    assert bench_cmd._quant_flags(ns) == ["--quantization", "w8a8_int8"]


@pytest.mark.slow
def test_weight_formats_side_by_side(tiny_llama, capsys):
    argv = ["decode", "--model-path", str(tiny_llama), "--weight-formats", "float32,float32:int8wo",
            "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1", "--agreement-prompts", "1",
            "--json", "--no-progress"]
    assert bench_cmd.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["tables"][0]["rows"]
    assert [(r["weights"], r["weight_format"]) for r in rows] == [("float32", "none"),
                                                                  ("float32 + int8wo", "torchao:int8wo+embedding")]
    assert rows[1]["weight_bytes"] < rows[0]["weight_bytes"] and "int8pack" in rows[1]["linear"]
    assert rows[0]["agreement"] == 1.0 and rows[1]["compared_with"] == "float32"
    assert 0 <= rows[1]["agreement"] <= 1 and all(r["decode_tps"] is None or r["decode_tps"] > 0 for r in rows)
