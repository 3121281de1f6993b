"""Command-line flags -> ServerArgs, bad combinations exit 2 with a clear message, and `tierlm` dispatch."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from tierlm import cli
from tierlm.runtime.server_args import ServerArgs
from tierlm.server.commands.cli_args import parse_args


def test_defaults_match_server_args() -> None:
    assert parse_args([]) == ServerArgs()


def test_every_flag_maps_to_its_field(tmp_path: Path) -> None:
    args = parse_args([
        "--model-path", "Qwen/Qwen2.5-0.5B-Instruct", "--tokenizer-path", "/tok", "--host", "0.0.0.0",
        "--port", "8000", "--context-length", "4096", "--max-running-requests", "8", "--max-total-tokens", "20000",
        "--page-size", "32", "--chunked-prefill-size", "512", "--dtype", "bfloat16", "--device", "cuda",
        "--served-model-name", "qwen", "--api-key", "k", "--mem-fraction-static", "0.8", "--log-level", "debug",
        "--random-seed", "5", "--trust-remote-code", "--skip-warmup", "--disable-radix-cache",
    ])
    assert (args.model_path, args.tokenizer_path, args.host, args.port) == ("Qwen/Qwen2.5-0.5B-Instruct", "/tok", "0.0.0.0", 8000)
    assert (args.context_length, args.max_running_requests, args.max_total_tokens) == (4096, 8, 20000)
    assert (args.page_size, args.chunked_prefill_size, args.dtype, args.device) == (32, 512, "bfloat16", "cuda")
    assert (args.served_model_name, args.api_key, args.mem_fraction_static, args.log_level) == ("qwen", "k", 0.8, "debug")
    assert (args.random_seed, args.trust_remote_code, args.warmup, args.disable_radix_cache) == (5, True, False, True)
    assert args.model_name == "qwen"


def test_security_and_logging_flags() -> None:
    args = parse_args(["--admin-api-key", "adm", "--allowed-origins", "http://localhost:3000", "tierlm.lan",
                       "--max-request-bytes", "65536", "--log-requests", "--trust-unverified-architecture"])
    assert (args.admin_api_key, args.allowed_origins) == ("adm", ["http://localhost:3000", "tierlm.lan"])
    assert (args.max_request_bytes, args.log_requests, args.trust_unverified_architecture) == (65536, True, True)
    assert args.to_dict()["admin_api_key"] == "***"  # /server_info and the startup log never show keys


def test_chat_template_and_reasoning_parser_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--chat-template", "chatml", "--reasoning-parser", "deepseek-r1"])
    assert (args.chat_template, args.reasoning_parser) == ("chatml", "deepseek-r1")
    for name in ("qwen3", "gpt-oss"):
        assert parse_args(["--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(SystemExit) as e:
        parse_args(["--reasoning-parser", "nope"])
    assert e.value.code == 2 and "deepseek-r1" in capsys.readouterr().err


def test_model_alias() -> None:
    assert parse_args(["--model", "m"]).model_path == "m"


def test_hicache_flags(tmp_path: Path) -> None:
    args = parse_args([
        "--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-size", "1.5",
        "--hicache-write-policy", "write_back", "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "direct",
        "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", '{"file_path": "/tmp/kv"}',
    ])
    assert args.enable_hierarchical_cache
    assert (args.hicache_ratio, args.hicache_size) == (3.0, 1.5)
    assert (args.hicache_write_policy, args.hicache_mem_layout, args.hicache_io_backend) == ("write_back", "layer_first", "direct")
    assert (args.hicache_storage_backend, args.hicache_storage_prefetch_policy) == ("file", "wait_complete")
    assert json.loads(args.hicache_storage_backend_extra_config) == {"file_path": "/tmp/kv"}


def test_extra_config_from_file(tmp_path: Path) -> None:
    f = tmp_path / "cfg.json"
    f.write_text('{"file_path": "/data/kv", "max_gb": 4}')
    args = parse_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                       "--hicache-storage-backend-extra-config", f"@{f}"])
    assert json.loads(args.hicache_storage_backend_extra_config) == {"file_path": "/data/kv", "max_gb": 4}


@pytest.mark.parametrize("argv,message", [
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--enable-hierarchical-cache", "--disable-radix-cache"], "needs the radix cache"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--chunked-prefill-size", "8", "--page-size", "16"], "--chunked-prefill-size"),
    (["--port", "70000"], "--port"),
    (["--hicache-storage-backend", "file"], "needs --enable-hierarchical-cache"),
    (["--enable-hierarchical-cache", "--hicache-ratio", "0.5"], "--hicache-ratio must be > 1"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", "{oops"], "not valid JSON"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", "[1]"], "must be a JSON object"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", "@/nonexistent/cfg.json"], "cannot read"),
    (["--dtype", "int8"], "invalid choice"),
    (["--device", "tpu"], "invalid choice"),
    (["--hicache-write-policy", "sometimes"], "invalid choice"),
    (["--port", "eighty"], "invalid int value"),
    (["--max-request-bytes", "100"], "--max-request-bytes must be at least 1024"),
])
def test_bad_values_exit_2_with_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_dispatches_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServerArgs] = []
    monkeypatch.setattr("tierlm.server.commands.serve.run_server", seen.append)
    assert cli.main(["serve", "--model-path", "m", "--port", "1234"]) == 0
    assert (seen[0].model_path, seen[0].port) == ("m", 1234)


def test_cli_lazy_commands(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[list[str]] = []
    fake = types.ModuleType("tierlm.server.commands.doctor")
    fake.main = lambda argv: calls.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tierlm.server.commands.doctor", fake)
    assert cli.main(["doctor", "--json"]) == 0
    assert calls == [["--json"]]
    monkeypatch.setitem(sys.modules, "tierlm.server.commands.bench.command", None)  # import of this name fails
    assert cli.main(["bench"]) == 2
    assert "not available" in capsys.readouterr().err


def test_cli_unknown_command_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out


# ---------------------------------------------------------------- SGLang compatibility (docs/sglang-compat.md)
COMPAT_DOC = Path(__file__).resolve().parents[1] / "docs" / "sglang-compat.md"


def _compat_rows() -> list[tuple[str, str, list[str]]]:
    """(flag column, status, example argv) of every row of the table in docs/sglang-compat.md."""
    import shlex

    rows = []
    for line in COMPAT_DOC.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        flag, status, example = cells[0], cells[1], cells[2].strip("`")
        rows.append((flag, status, shlex.split(example)))
    return rows


def _default_cells() -> list[tuple[str, str, str]]:
    """(first flag, status, tierlm default cell) of every supported/accepted row that states a default."""
    out = []
    for line in COMPAT_DOC.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[1] in ("supported", "accepted") and cells[4] != "—":
            out.append((cells[0].split("`")[1], cells[1], cells[4]))
    return out


@pytest.mark.parametrize("flag,status,cell", _default_cells(), ids=[r[0] for r in _default_cells()])
def test_compat_table_defaults_match_the_parser(flag: str, status: str, cell: str) -> None:
    """The `tierlm default` column is the parser's default, so a changed default without a doc change fails here."""
    import ast

    from tierlm.server.commands.cli_args import build_parser

    assert cell.startswith("`") and cell.endswith("`"), f"{flag}: write the default as `value` (or — for none)"
    text = cell.strip("`")
    try:
        documented = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        documented = text
    action = build_parser()._option_string_actions[flag]
    assert action.default == documented, f"{flag}: parser default {action.default!r}, table says {text}"


def test_compat_table_states_defaults_where_sglang_has_one() -> None:
    """Every flag row of a supported or accepted setting has both default cells."""
    assert len(_default_cells()) > 50


def test_compat_table_is_complete() -> None:
    rows = _compat_rows()
    assert len(rows) > 40 and {s for _, s, _ in rows} == {"supported", "accepted", "refused"}
    from tierlm.server.commands.cli_args import REFUSED_SGLANG_FLAGS

    documented = {f.split("`")[1] for f, _, _ in rows}
    assert set(REFUSED_SGLANG_FLAGS) <= documented  # every refused flag of the parser has its row


@pytest.mark.parametrize("flag,status,argv", _compat_rows(), ids=[r[0] + " " + r[1] for r in _compat_rows()])
def test_compat_table_matches_parser(flag: str, status: str, argv: list[str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    if status in ("supported", "accepted"):
        parse_args(argv)  # parses and passes every check
        return
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "unrecognized" not in err and "usage:" not in err
    assert argv[0].split("-")[2] in err  # the line names the flag it refuses


def test_sglang_flags_map_to_fields() -> None:
    args = parse_args([
        "--revision", "v1", "--download-dir", "/hf", "--max-prefill-tokens", "4096", "--stream-interval", "3",
        "--max-queued-requests", "5", "--watchdog-timeout", "12.5", "--attention-backend", "mlx_paged",
        "--tp", "1", "--dp-size", "1", "--disable-cuda-graph", "--cuda-graph-max-bs", "8", "--enable-metrics",
        "--enable-cache-report", "--skip-server-warmup", "--kv-cache-dtype", "auto", "--schedule-policy", "fcfs",
        "--enable-torch-compile", "--torch-compile-max-bs", "16",
    ])
    assert (args.enable_torch_compile, args.torch_compile_max_bs) == (True, 16)
    assert (args.revision, args.download_dir, args.max_prefill_tokens, args.stream_interval) == ("v1", "/hf", 4096, 3)
    assert (args.max_queued_requests, args.watchdog_timeout, args.attention_backend) == (5, 12.5, "mlx_paged")
    assert (args.tp_size, args.dp_size, args.disable_cuda_graph, args.cuda_graph_max_bs) == (1, 1, True, 8)
    assert (args.enable_metrics, args.enable_cache_report, args.warmup) == (True, True, False)
    d = ServerArgs()
    assert (d.max_prefill_tokens, d.stream_interval, d.watchdog_timeout, d.schedule_policy) == (16384, 1, 300.0, "fcfs")
    assert (d.kv_cache_dtype, d.tp_size, d.dp_size, d.max_queued_requests) == ("auto", 1, 1, None)


@pytest.mark.parametrize("argv,message", [
    (["--tp-size", "4"], "sglang-router"),
    (["--data-parallel-size", "2"], "sglang-router"),
    (["--kv-cache-dtype", "fp4_e2m1"], "fp8_e4m3"),
    (["--kv-cache-dtype", "int8"], "fp8_e5m2"),
    (["--schedule-policy", "priority"], "lpm"),
    (["--schedule-policy", "lifo"], "dfs-weight"),
    (["--speculative-algorithm", "EAGLE"], "NGRAM only"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "10"], "one chain"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], "at least one draft"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"], "min <= max"),
    (["--radix-eviction-policy", "mru"], "lru, lfu, slru"),
    (["--quantization", "awq"], "--quantization awq"),
    (["--attention-backend", "fa3"], "tierlm_paged"),
    (["--max-prefill-tokens", "8"], "--max-prefill-tokens"),
    (["--stream-interval", "0"], "--stream-interval"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout"),
])
def test_sglang_refusals_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_context_length_above_model_limit(caplog: pytest.LogCaptureFixture) -> None:
    from tierlm.runtime.load_plan import check_context_length
    from tierlm.runtime.errors import StartupError

    assert check_context_length(None, 2048, {}) == 2048
    assert check_context_length(1024, 2048, {}) == 1024
    with pytest.raises(StartupError, match="SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
        check_context_length(4096, 2048, {})
    assert check_context_length(4096, 2048, {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}) == 4096


def test_attention_backend_must_match_the_backend() -> None:
    from tierlm.platforms import Decision
    from tierlm.runtime.errors import StartupError
    from tierlm.runtime.load_plan import resolve_attention_backend

    resolve_attention_backend(ServerArgs(attention_backend="tierlm_paged"), Decision("torch", "cpu"), {})
    resolve_attention_backend(ServerArgs(), Decision("mlx", "mps"), {})
    with pytest.raises(StartupError, match="use --attention-backend mlx_paged"):
        resolve_attention_backend(ServerArgs(attention_backend="tierlm_paged"), Decision("mlx", "mps"), {})


def test_hicache_io_backend_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tierlm.platforms import Decision
    from tierlm.runtime.engine_setup import log_accepted_flags

    with caplog.at_level(logging.INFO, logger="tierlm.runtime.engine_setup"):
        log_accepted_flags(ServerArgs(enable_hierarchical_cache=True, hicache_io_backend="direct"),
                           Decision("mlx", "mps"))
    assert "on MLX kernel and direct are the same copy" in caplog.text


def test_neutral_values_of_refused_flags_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--nnodes", "1", "--node-rank", "0", "--pp-size", "1", "--ep", "1", "--load-format", "auto",
                       "--disaggregation-mode", "null", "--base-gpu-id", "0", "--json-model-override-args", "{}"])
    assert set(args.accepted_sglang_flags) == {"--nnodes", "--node-rank", "--pp-size", "--ep-size", "--load-format",
                                               "--disaggregation-mode", "--base-gpu-id", "--json-model-override-args"}
    with pytest.raises(SystemExit) as exc:
        parse_args(["--base-gpu-id", "1"])
    assert exc.value.code == 2 and "CUDA_VISIBLE_DEVICES" in capsys.readouterr().err


def test_accepted_sglang_flags_are_recorded_for_the_log(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tierlm.platforms import Decision
    from tierlm.runtime.engine_setup import log_accepted_flags

    assert parse_args([]).accepted_sglang_flags == {}
    args = parse_args(["--disable-overlap-schedule", "--decode-log-interval", "10", "--sampling-backend", "pytorch",
                       "--cuda-graph-bs", "1", "2", "--decode-log-interval", "40"])
    assert set(args.accepted_sglang_flags) == {"--disable-overlap-schedule", "--sampling-backend", "--cuda-graph-bs"}
    assert args.accepted_sglang_flags["--cuda-graph-bs"].startswith("[1, 2]: ")
    with caplog.at_level(logging.INFO, logger="tierlm.runtime.engine_setup"):
        log_accepted_flags(args, Decision("torch", "cpu"))
    assert "--disable-overlap-schedule: accepted; tierlm has no overlap scheduler" in caplog.text
    assert "--sampling-backend: accepted; pytorch: tierlm samples" in caplog.text


def test_sglang_spellings_of_supported_values() -> None:
    args = parse_args(["--dtype", "half", "--log-level", "WARNING", "--reasoning-parser", "auto",
                       "--tool-call-parser", "auto", "--chunked-prefill-size", "-1", "--max-prefill-tokens", "8192"])
    assert (args.dtype, args.log_level, args.reasoning_parser, args.tool_call_parser) == ("float16", "warning", None, None)
    assert args.chunked_prefill_size == 8192  # SGLang's "no chunking": a step prefills up to --max-prefill-tokens
    assert parse_args(["--dtype", "float"]).dtype == "float32"
    assert parse_args(["--dp", "1"]).dp_size == 1


@pytest.mark.parametrize("argv,message", [
    (["--grammar-backend", "llguidance"], "use xgrammar"),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "hf3fs"], "are not implemented"),
    (["--tokenizer-mode", "slow"], "fast tokenizer"),
    (["--preferred-sampling-params", '{"temperature": 0}'], "send them with each request"),
    (["--ssl-certfile", "c.pem"], "reverse proxy"),
])
def test_more_sglang_refusals(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
