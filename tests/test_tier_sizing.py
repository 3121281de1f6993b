"""`tierlm doctor` reports the KV pools `tierlm serve` allocates: both size them with platforms/memory_plan's
size_kv_tiers from the same inputs, and this holds them to it with a real engine setup on the built-in model."""
from __future__ import annotations

import json

import pytest

from tierlm.platforms import Facts
from tierlm.runtime import engine_setup
from tierlm.server.commands import doctor as doctor_cmd
from tierlm.server.commands.cli_args import parse_args

GiB = 1024**3
# A recorded CPU machine (as `tierlm doctor --json` reports it), so doctor and serve see the same facts.
CPU_BOX = Facts.from_dict(dict(
    os_name="Linux", arch="x86_64", cpu_count=2, ram_total_bytes=int(23.5 * GiB), ram_available_bytes=int(22.9 * GiB),
    torch_version="2.13.0+cpu",
))
ENV = {"TIERLM_BACKEND": "torch"}
BUILTIN_KV_BYTES_PER_TOKEN = 2 * 5 * 4 * 8 * 4  # stories260K: K and V x 5 layers x 4 KV heads x 8 dims x float32

FLAG_SETS = {
    "default": [],
    "max-total-tokens": ["--max-total-tokens", "3000"],
    "hicache-ratio": ["--enable-hierarchical-cache", "--hicache-ratio", "2"],
    "hicache-size": ["--enable-hierarchical-cache", "--hicache-size", "0.3"],
    "mem-fraction-static": ["--mem-fraction-static", "0.0005"],  # memory-bound: below the context cap
    "context-length": ["--context-length", "512", "--max-running-requests", "3", "--page-size", "4"],
    "kv-cache-dtype": ["--kv-cache-dtype", "bf16", "--mem-fraction-static", "0.0005"],  # half the bytes per token
}


def doctor_json(flags: list[str], facts: Facts = CPU_BOX) -> dict:
    report = doctor_cmd.diagnose(facts, dict(ENV), ["--json", *flags])
    assert report["errors"] == [], report["errors"]
    return report


def serve_pools(flags: list[str], monkeypatch) -> dict:
    """The pools a real engine setup allocates with these flags (the built-in model, torch on CPU, same facts)."""
    monkeypatch.setattr(engine_setup, "detect", lambda: CPU_BOX)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    args = parse_args([*flags, "--skip-warmup", "--grammar-backend", "none"])
    parts = engine_setup.build_engine_parts(args, emit=lambda req, out: None)
    try:
        acc = parts.cache.accounting()
        return {"device_pages": acc["total_pages"], "host_pages": acc.get("host_total_pages", 0),
                "page_size": acc["page_size"], "kv_bytes_per_token": parts.backend.kv_bytes_per_token(),
                "context_length": parts.context_length}
    finally:
        parts.close()


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_doctor_reports_the_pools_serve_allocates(name, monkeypatch):
    flags = FLAG_SETS[name]
    memory = doctor_json(flags)["memory"]
    served = serve_pools(flags, monkeypatch)
    assert memory["sized_in"] == "tokens"
    reported = {k: memory[k] for k in ("device_pages", "host_pages", "page_size", "kv_bytes_per_token",
                                       "context_length")}
    assert reported == served
    assert memory["device_kv_tokens"] == served["device_pages"] * served["page_size"]
    assert memory["device_kv_bytes"] == memory["device_kv_tokens"] * served["kv_bytes_per_token"]


def test_each_flag_set_sizes_differently():
    """The flag sets above exercise different rules (else the agreement test would prove little)."""
    pools = {name: doctor_json(flags)["memory"] for name, flags in FLAG_SETS.items()}
    default = pools["default"]
    assert default["device_kv_tokens"] == 512 * 32  # the CPU context cap: 1 x 512 x --max-running-requests 32
    assert any("capped at 1 x context length 512 x max running requests 32" in r for r in default["reasons"])
    assert pools["max-total-tokens"]["device_kv_tokens"] == 3000 // 16 * 16
    assert pools["hicache-ratio"]["host_pages"] == 2 * default["device_pages"]  # the ratio of the capped pool
    assert pools["hicache-size"]["host_pages"] == int(0.3e9) // (16 * BUILTIN_KV_BYTES_PER_TOKEN)
    small = pools["mem-fraction-static"]["device_kv_tokens"]
    assert 0 < small < default["device_kv_tokens"]
    assert pools["context-length"]["device_kv_tokens"] == 512 * 3
    assert pools["kv-cache-dtype"]["kv_bytes_per_token"] == BUILTIN_KV_BYTES_PER_TOKEN // 2
    assert pools["kv-cache-dtype"]["device_pages"] == pytest.approx(2 * small // 16, abs=2)  # twice the tokens


def test_doctor_text_shows_the_json_numbers(capsys, monkeypatch):
    monkeypatch.setattr(doctor_cmd, "detect", lambda: CPU_BOX)
    monkeypatch.setenv("TIERLM_BACKEND", "torch")
    flags = ["--enable-hierarchical-cache"]
    assert doctor_cmd.main(["--json", *flags]) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    assert doctor_cmd.main(flags) == 0
    text = capsys.readouterr().out
    assert f"built-in model (stories260K) (float32, KV float32): {BUILTIN_KV_BYTES_PER_TOKEN} bytes/token" in text
    assert f"{m['device_pages']} pages x 16 = {m['device_kv_tokens']} tokens, {m['device_kv_bytes'] / 1e6:.2f} MB" in text
    assert f"{m['host_pages']} pages x 16 = {m['host_kv_tokens']} tokens, {m['host_kv_bytes'] / 1e6:.2f} MB (ratio 2)" in text


def test_doctor_without_the_model_at_hand_reports_bytes_only():
    """A hub id that is not downloaded: byte budgets, never labelled as tokens, and a warning that says why."""
    report = doctor_json(["--model-path", "tierlm-tests/not-downloaded", "--enable-hierarchical-cache",
                          "--max-total-tokens", "1000"])
    memory = report["memory"]
    assert memory["sized_in"] == "bytes" and memory["device_kv_bytes"] > 0 and memory["host_kv_bytes"] > 0
    assert not [k for k in memory if k.endswith(("_tokens", "_pages", "_per_token"))], sorted(memory)
    assert report["model"] is None
    assert any("not in the local Hugging Face cache" in w and "byte budgets only" in w for w in report["warnings"])
    assert any("--max-total-tokens 1000 is not applied" in w for w in report["warnings"])


def test_doctor_takes_the_context_length_from_config_json(tmp_path):
    from tierlm.backends.model_source.demo import write_demo_model

    folder = write_demo_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    memory = doctor_json(["--model-path", str(folder)])["memory"]
    assert memory["context_length"] == 256 and memory["device_kv_tokens"] == 256 * 32
    report = doctor_cmd.diagnose(CPU_BOX, dict(ENV), ["--model-path", str(folder), "--context-length", "512"])
    assert any("above the model's limit" in e for e in report["errors"])  # serve refuses it the same way


def test_doctor_sizes_kv_in_the_kv_cache_dtype():
    memory = doctor_json(["--kv-cache-dtype", "fp8_e4m3"])["memory"]
    assert memory["kv_bytes_per_token"] == BUILTIN_KV_BYTES_PER_TOKEN // 4  # 1 byte per element, not float32's 4
    model = doctor_json(["--kv-cache-dtype", "bf16"])["model"]
    assert (model["dtype"], model["kv_cache_dtype"], model["kv_bytes_per_token"]) == ("float32", "bfloat16", BUILTIN_KV_BYTES_PER_TOKEN // 2)


def test_a_host_tier_of_no_pages_is_an_error_in_doctor_as_in_serve():
    report = doctor_cmd.diagnose(CPU_BOX, dict(ENV), ["--enable-hierarchical-cache", "--hicache-size", "0.000001"])
    assert any("host KV pool would hold no pages" in e for e in report["errors"]), report["errors"]
