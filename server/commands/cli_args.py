"""Command-line flags -> ServerArgs. Flag names and defaults follow SGLang so its launch commands run unchanged."""
from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from tierlm.runtime.server_args import ServerArgs
from tierlm.server.pipeline.parsing.reasoning import REASONING_PARSER_NAMES
from tierlm.server.pipeline.parsing.tool_registry import TOOL_CALL_PARSERS

_DEFAULTS = ServerArgs()

# SGLang flags a single-node user may pass that tierlm has no counterpart for: each stops startup (exit 2) with one
# line saying why and what to do instead, rather than argparse's bare "unrecognized arguments".
# docs/sglang-compat.md lists them with the rest; tests/test_cli_args.py holds the two to agreement.
REFUSED_SGLANG_FLAGS: dict[str, str] = {
    "--nnodes": "tierlm runs on one node; start one instance per node and put sglang-router in front",
    "--node-rank": "tierlm runs on one node; start one instance per node and put sglang-router in front",
    "--dist-init-addr": "tierlm runs on one node; start one instance per node and put sglang-router in front",
    "--pp-size": "pipeline parallelism is not implemented; run one instance per device behind sglang-router",
    "--ep-size": "expert parallelism is not implemented; drop the flag",
    "--enable-dp-attention": "data-parallel attention needs several devices; tierlm runs one model copy on one device",
    "--lora-paths": "LoRA adapters are not implemented yet; merge the adapter into the weights and serve that folder",
    "--enable-lora": "LoRA adapters are not implemented yet; merge the adapter into the weights and serve that folder",
    "--load-format": "tierlm loads safetensors only; drop the flag (other formats: convert to safetensors first)",
    "--disaggregation-mode": "prefill/decode disaggregation is not implemented; drop the flag",
    "--is-embedding": "tierlm serves generative models only; embeddings are not implemented",
    "--speculative-draft-model-path": "draft-model speculative decoding (EAGLE) is not implemented; use --speculative-algorithm NGRAM",
    "--speculative-num-steps": "draft-model speculative decoding (EAGLE) is not implemented; use --speculative-algorithm NGRAM",
    "--speculative-eagle-topk": "draft-model speculative decoding (EAGLE) is not implemented; use --speculative-algorithm NGRAM",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented; run one instance per device behind sglang-router",
    "--expert-parallel-size": "expert parallelism is not implemented; drop the flag",
    "--nccl-init-addr": "tierlm runs on one node; start one instance per node and put sglang-router in front",
    "--tokenizer-mode": "tierlm always uses the model's fast tokenizer (slow ones can split text differently); "
                        "drop the flag",
    "--skip-tokenizer-init": "tierlm tokenizes prompts and detokenizes output itself; send text, or input_ids to "
                             "/generate, without the flag",
    "--json-model-override-args": "overriding the model config is not implemented; edit config.json in a copy of "
                                  "the model folder and serve that",
    "--base-gpu-id": "tierlm uses the first visible GPU; choose another with CUDA_VISIBLE_DEVICES=N",
    "--cpu-offload-gb": "offloading weights to host memory is not implemented; use a smaller model",
    "--enable-multimodal": "tierlm serves text-only models",
    "--tool-server": "built-in and MCP tool servers are not implemented; run the tools in the client",
    "--preferred-sampling-params": "server-side default sampling parameters are not implemented; send them with "
                                   "each request",
    "--allow-auto-truncate": "an over-long prompt is refused with a 400, never truncated; shorten it in the client",
    "--enable-priority-scheduling": "request priorities are not implemented; use --schedule-policy lpm or fcfs",
    "--enable-custom-logit-processor": "custom logit processors (Python code sent with requests) are not "
                                       "implemented; drop the flag",
    "--constrained-json-whitespace-pattern": "it applies to the outlines and llguidance grammar backends, which "
                                             "tierlm does not have (xgrammar JSON has no free whitespace)",
    "--ssl-keyfile": "TLS is not built in; put a reverse proxy (nginx, caddy) in front for HTTPS",
    "--ssl-certfile": "TLS is not built in; put a reverse proxy (nginx, caddy) in front for HTTPS",
}
# A refused flag given the value that means "off" or "one" in SGLang changes nothing: that value is accepted (and
# logged at startup), so `--nnodes 1 --pp-size 1 --load-format auto` still starts.
NEUTRAL_SGLANG_VALUES: dict[str, tuple[str, ...]] = {
    "--nnodes": ("1",), "--node-rank": ("0",), "--pp-size": ("1",), "--pipeline-parallel-size": ("1",),
    "--ep-size": ("1",), "--expert-parallel-size": ("1",), "--load-format": ("auto", "safetensors"),
    "--disaggregation-mode": ("null",), "--tokenizer-mode": ("auto",), "--json-model-override-args": ("{}",),
    "--base-gpu-id": ("0",), "--cpu-offload-gb": ("0",),
}

# SGLang flags that have nothing to change in tierlm (the reason says why): parsed with SGLang's type and default,
# and logged at startup when given (ServerArgs.accepted_sglang_flags, runtime/engine_setup.py log_accepted_flags).
# None of them changes the generated text.
ACCEPTED_SGLANG_FLAGS: dict[str, tuple[dict[str, Any], str]] = {
    "--enable-p2p-check": ({"action": "store_true"}, "one device: there is no peer-to-peer access to check"),
    "--show-time-cost": ({"action": "store_true"}, "tierlm has no custom time-cost marks to show"),
    "--decode-log-interval": ({"type": int, "default": 40}, "tierlm logs per request, not every N decode steps"),
    "--file-storage-path": ({"default": "sglang_storage"}, "tierlm has no file API (/v1/files) that stores files"),
    "--enable-mixed-chunk": ({"action": "store_true"}, "tierlm's scheduler decides how prefill chunks and decodes "
                                                       "share a step; the output does not depend on it"),
    "--disable-overlap-schedule": ({"action": "store_true"}, "tierlm has no overlap scheduler to disable"),
    "--num-continuous-decode-steps": ({"type": int, "default": 1}, "tierlm schedules before every decode step"),
    "--sampling-backend": ({"default": None, "choices": ["flashinfer", "pytorch", "ascend"]},
                           "tierlm samples with its own torch (or MLX) code"),
    "--constrained-json-disable-any-whitespace": ({"action": "store_true"},
                                                  "xgrammar JSON is already generated without free whitespace"),
    "--sleep-on-idle": ({"action": "store_true"}, "the idle scheduler already sleeps until a request arrives"),
    "--crash-dump-folder": ({"default": None}, "tierlm writes no crash dumps; the error and its traceback are in "
                                               "the log"),
    "--dist-timeout": ({"type": int, "default": None}, "tierlm does not use torch.distributed"),
    "--nccl-port": ({"type": int, "default": None}, "tierlm does not use NCCL"),
    "--gpu-id-step": ({"type": int, "default": 1}, "one device"),
    "--tokenizer-worker-num": ({"type": int, "default": 1}, "tokenization runs on a thread pool of the server "
                                                            "process"),
    "--log-requests-level": ({"type": int, "default": 2, "choices": [0, 1, 2, 3]},
                             "--log-requests logs each request's prompt and output text at one level"),
    "--cuda-graph-bs": ({"type": int, "nargs": "+", "default": None},
                        "tierlm's buckets are 1, 2, 4, 8, then multiples of 8 up to --cuda-graph-max-bs"),
    "--disable-cuda-graph-padding": ({"action": "store_true"},
                                     "tierlm always pads a decode step to its bucket (steps over the largest run "
                                     "eagerly)"),
    "--disable-chunked-prefix-cache": ({"action": "store_true"}, "a DeepSeek MLA optimization tierlm does not have"),
}


class _RefuseFlag(argparse.Action):
    """An SGLang flag tierlm cannot honour: exit 2 with the reason (one line, no usage dump); its neutral value
    (NEUTRAL_SGLANG_VALUES) is accepted and noted for the startup log."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        if values in NEUTRAL_SGLANG_VALUES.get(option_string, ()):
            _note_accepted(namespace, option_string, f"{values}: SGLang's value for one node, one device, no "
                                                      "change: nothing to do")
            return
        parser.exit(2, f"{parser.prog}: error: {option_string}: {REFUSED_SGLANG_FLAGS[option_string]}\n")


def _note_accepted(namespace: argparse.Namespace, flag: str, what: str) -> None:
    noted = dict(getattr(namespace, "accepted_sglang_flags", None) or {})
    noted[flag] = what
    namespace.accepted_sglang_flags = noted


def _dest(flag: str) -> str:
    return "sglang_accepted_" + flag.lstrip("-").replace("-", "_")


def build_parser(prog: str = "tierlm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Start the tierlm OpenAI-compatible server (radix prefix cache, tiered KV cache).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument("--model-path", "--model", dest="model_path", default=None,
                       help="Hugging Face repo id or local folder; omitted -> the built-in model stories260K "
                            "(a tiny story writer shipped with tierlm)")
    model.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    model.add_argument("--served-model-name", default=None, help="name reported in /v1/models and responses")
    model.add_argument("--context-length", type=int, default=None, help="defaults to the model's maximum")
    model.add_argument("--dtype", default=_DEFAULTS.dtype,
                       choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                       help="half = float16, float = float32 (SGLang's spellings)")
    model.add_argument("--device", default=_DEFAULTS.device, choices=["auto", "cpu", "cuda", "mps"],
                       help="mps runs MLX on Apple Silicon")
    model.add_argument("--trust-remote-code", action="store_true")
    model.add_argument("--trust-unverified-architecture", action="store_true",
                       help="serve an architecture whose output the reference tests do not verify (docs/models.md)")
    model.add_argument("--chat-template", default=None,
                       help="a jinja chat template file (or tokenizer_config.json-style .json), the template text, "
                            "or a built-in name: chatml, chatml-tools (alias qwen2.5); overrides the model's own")
    model.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request replace the chat template (chat_template, or chat_template_kwargs."
                            "chat_template; vLLM's flag); without it such a request gets a 400")
    model.add_argument("--reasoning-parser", default=None, choices=["auto", *REASONING_PARSER_NAMES],
                       help="split the thinking text into reasoning_content (docs/api.md); default (or auto): "
                            "chosen from the model when unambiguous (gpt-oss; qwen3 with <think> in its chat template)")
    model.add_argument("--tool-call-parser", default=None, choices=["auto", *TOOL_CALL_PARSERS],
                       help="read tool calls out of the model's output (docs/api.md); default (or auto): chosen from "
                            "the model "
                            "when unambiguous (<tool_call> in the chat template -> qwen25/hermes, <|python_tag|> -> "
                            "llama3, [TOOL_CALLS] -> mistral, gpt_oss -> gpt-oss)")

    http = p.add_argument_group("http")
    http.add_argument("--host", default=_DEFAULTS.host)
    http.add_argument("--port", type=int, default=_DEFAULTS.port)
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on API routes")
    http.add_argument("--admin-api-key", default=None,
                      help="require this key on admin routes (/flush_cache); defaults to --api-key")
    http.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                      help="browser origins (e.g. http://localhost:3000; they also get CORS headers) and host names "
                           "allowed besides this server's own; '*': any")
    http.add_argument("--max-request-bytes", type=int, default=_DEFAULTS.max_request_bytes,
                      help="larger request bodies are refused with 413 before they are read")
    http.add_argument("--log-level", default=_DEFAULTS.log_level, type=str.lower,
                      choices=["debug", "info", "warning", "error", "critical"])
    http.add_argument("--log-requests", action="store_true",
                      help="also log each request's prompt and generated text (the per-request summary line is always logged)")
    http.add_argument("--keep-anthropic-billing-header", action="store_true",
                      help="keep Claude Code's first system block 'x-anthropic-billing-header: ...' in the prompt; by "
                           "default it is left out: its hash changes with every prompt, so no two sessions would share "
                           "their cached prefix (docs/api.md)")

    sched = p.add_argument_group("scheduling and memory")
    sched.add_argument("--max-running-requests", type=int, default=_DEFAULTS.max_running_requests)
    sched.add_argument("--max-total-tokens", type=int, default=None, help="cap on device KV tokens")
    sched.add_argument("--page-size", type=int, default=_DEFAULTS.page_size)
    sched.add_argument("--chunked-prefill-size", type=int, default=_DEFAULTS.chunked_prefill_size,
                       help="prompt tokens prefilled per step; -1 (SGLang: no chunking): --max-prefill-tokens per "
                            "step")
    sched.add_argument("--mem-fraction-static", type=float, default=None,
                       help="share of free device memory for weights + KV pool")
    sched.add_argument("--disable-radix-cache", action="store_true")
    sched.add_argument("--cache-pin-fraction", type=float, default=_DEFAULTS.cache_pin_fraction,
                       help="share of each cache tier (device, host) that prompt-caching pins (Anthropic cache_control "
                            "breakpoints) may hold; a pin beyond it is cut short (default 0.5; 0 turns pins off)")
    sched.add_argument("--random-seed", type=int, default=_DEFAULTS.random_seed)
    sched.add_argument("--grammar-backend", default=_DEFAULTS.grammar_backend,
                       help="structured output (json_schema, regex, ebnf, response_format): xgrammar, or none to "
                            "refuse every grammar with a 400")
    sched.add_argument("--grammar-compile-timeout", type=float, default=_DEFAULTS.grammar_compile_timeout,
                       help="seconds one grammar may compile; past it its requests get a 400 and the result is "
                            "dropped")
    sched.add_argument("--grammar-cache-mb", type=int, default=_DEFAULTS.grammar_cache_mb,
                       help="memory for compiled grammars kept for reuse (least recently used go first); 0 keeps none")
    sched.add_argument("--skip-warmup", "--skip-server-warmup", dest="skip_warmup", action="store_true",
                       help="do not run a warmup request at startup")
    sched.add_argument("--max-prefill-tokens", type=int, default=_DEFAULTS.max_prefill_tokens,
                       help="most prompt tokens prefilled in one step (together with --chunked-prefill-size)")
    sched.add_argument("--stream-interval", type=int, default=_DEFAULTS.stream_interval,
                       help="streaming: send an increment every N generated tokens")
    sched.add_argument("--max-queued-requests", type=int, default=None,
                       help="requests beyond this many waiting get 503; default unbounded")
    sched.add_argument("--schedule-policy", default=_DEFAULTS.schedule_policy,
                       help="admission order of waiting requests: fcfs, lpm (longest cached prefix first), "
                            "dfs-weight (depth-first over the cached prefix tree), random, lof (longest output first)")
    sched.add_argument("--watchdog-timeout", type=float, default=_DEFAULTS.watchdog_timeout,
                       help="a model step that runs longer (seconds) marks the server unhealthy: error log, 503s")

    compat = p.add_argument_group("SGLang compatibility (docs/sglang-compat.md)")
    compat.add_argument("--revision", default=None, help="hub branch, tag or commit of --model-path")
    compat.add_argument("--download-dir", default=None, help="hub cache folder for --model-path downloads")
    compat.add_argument("--quantization", default=None,
                        help="quantize weights at load: w8a8_int8, fp8 (torch, through torchao); q4, q8, "
                             "q4-g<group>, q8-g<group> (mlx.nn.quantize; group 32, 64 or 128, default 64)")
    compat.add_argument("--torchao-config", default=None,
                        help="torch backend: quantize weights at load (torchao's recipes): int8wo, int8dq, "
                             "int4wo-<group> (CPU: torch's weight-only kernels, embedding included), fp8wo, "
                             "fp8dq-per_row (CUDA sm_89+) (docs/models.md, weight formats)")
    compat.add_argument("--kv-cache-dtype", default=_DEFAULTS.kv_cache_dtype,
                        help="dtype of the KV pages in every tier: auto (the model's), bf16/bfloat16, fp8_e4m3, "
                             "fp8_e5m2 (8-bit: half the bytes of bf16, dequantized when attention reads them)")
    compat.add_argument("--attention-backend", default=None,
                        help="torch backend: triton (kernels that read KV pages in place; CUDA) or torch_native "
                             "(SDPA over gathered pages; tierlm_paged is its old name); MLX: mlx_paged. Default: "
                             "triton on CUDA when Triton is installed, else torch_native (mlx_paged on MLX); "
                             "flashinfer is refused")
    compat.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tp_size", type=int, default=_DEFAULTS.tp_size, help="only 1")
    compat.add_argument("--data-parallel-size", "--dp-size", dest="dp_size", type=int, default=_DEFAULTS.dp_size, help="only 1")
    compat.add_argument("--disable-cuda-graph", action="store_true",
                        help="decode steps run eagerly on CUDA instead of as captured CUDA graphs")
    compat.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="largest decode batch captured as a CUDA graph (default: min(32, "
                             "--max-running-requests)); on CPU it turns on the same static, bucketed decode path "
                             "without capture"),
    compat.add_argument("--enable-torch-compile", action="store_true",
                        help="CPU: decode steps run through the model compiled by torch.compile (inductor), "
                             "compiled at startup (minutes the first time; cached on disk after)")
    compat.add_argument("--torch-compile-max-bs", type=int, default=_DEFAULTS.torch_compile_max_bs,
                        help="largest decode batch that runs compiled; larger steps run eagerly")
    compat.add_argument("--enable-metrics", action="store_true", help="accepted: /metrics is always on")
    compat.add_argument("--enable-cache-report", action="store_true",
                        help="accepted: usage always reports cached_tokens")
    compat.add_argument("--radix-eviction-policy", default=_DEFAULTS.radix_eviction_policy,
                        help="which unlocked cached pages go first when the device or host tier is full: lru, lfu "
                             "(fewest hits first), slru (pages hit twice are kept over the rest), loop (tierlm's own: "
                             "never-reused pages first, then pages reused once newest first, so reuse cycling "
                             "through more than the tier holds keeps part of the cycle)")
    spec = p.add_argument_group("speculative decoding (docs/speculative.md)")
    spec.add_argument("--speculative-algorithm", default=None,
                      help="NGRAM: draft tokens looked up in the tokens already seen, verified in one forward")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                      help="positions verified per step, the current token included (default: the max match window)")
    spec.add_argument("--speculative-ngram-min-match-window-size", type=int,
                      default=_DEFAULTS.speculative_ngram_min_match_window_size)
    spec.add_argument("--speculative-ngram-max-match-window-size", type=int,
                      default=_DEFAULTS.speculative_ngram_max_match_window_size)
    spec.add_argument("--speculative-ngram-min-bfs-breadth", type=int,
                      default=_DEFAULTS.speculative_ngram_min_bfs_breadth, help="only 1 (one chain of drafts)")
    spec.add_argument("--speculative-ngram-max-bfs-breadth", type=int,
                      default=_DEFAULTS.speculative_ngram_max_bfs_breadth, help="only 1 (one chain of drafts)")
    spec.add_argument("--speculative-ngram-match-type", default=_DEFAULTS.speculative_ngram_match_type,
                      help="BFS (the most recent continuation) or PROB (the most frequent one)")
    spec.add_argument("--speculative-ngram-branch-length", type=int,
                      default=_DEFAULTS.speculative_ngram_branch_length,
                      help="tokens kept after each n-gram in the shared store")
    spec.add_argument("--speculative-ngram-capacity", type=int, default=_DEFAULTS.speculative_ngram_capacity,
                      help="tokens the shared n-gram store of recent requests holds (LRU)")
    for flag, reason in REFUSED_SGLANG_FLAGS.items():
        compat.add_argument(flag, action=_RefuseFlag, nargs="?", default=argparse.SUPPRESS,
                            help=f"refused: {reason}")
    for flag, (kwargs, reason) in ACCEPTED_SGLANG_FLAGS.items():
        compat.add_argument(flag, dest=_dest(flag), **kwargs, help=f"accepted: {reason}")
    p.set_defaults(accepted_sglang_flags={})

    hc = p.add_argument_group("hierarchical cache (HiCache)")
    hc.add_argument("--enable-hierarchical-cache", action="store_true")
    hc.add_argument("--hicache-ratio", type=float, default=_DEFAULTS.hicache_ratio,
                    help="host pool size as a multiple of the device pool")
    hc.add_argument("--hicache-size", type=float, default=_DEFAULTS.hicache_size,
                    help="host pool size in GB; > 0 overrides --hicache-ratio")
    hc.add_argument("--hicache-write-policy", default=_DEFAULTS.hicache_write_policy,
                    choices=["write_through", "write_through_selective", "write_back"])
    hc.add_argument("--hicache-mem-layout", default=_DEFAULTS.hicache_mem_layout,
                    choices=["layer_first", "page_first", "page_first_direct"])
    hc.add_argument("--hicache-io-backend", default=_DEFAULTS.hicache_io_backend, choices=["kernel", "direct"])
    hc.add_argument("--hicache-storage-backend", default=None,
                    help="file (a folder) or mooncake (Mooncake Store shared by several servers: "
                         "pip install 'tierlm[mooncake]'); SGLang's others, hf3fs, nixl, ..., are refused")
    hc.add_argument("--hicache-storage-prefetch-policy", default=_DEFAULTS.hicache_storage_prefetch_policy,
                    choices=["best_effort", "wait_complete", "timeout"])
    hc.add_argument("--hicache-storage-backend-extra-config", default=None,
                    help="JSON object, or @path to a file holding one")
    return p


def _load_extra_config(value: str | None) -> str | None:
    """Resolve '@file', check the text is a JSON object, and return it as compact JSON text."""
    if value is None:
        return None
    from tierlm.runtime.cache.storage.registry import parse_extra_config

    return json.dumps(parse_extra_config(value))


def _check_cli_only(args: ServerArgs) -> None:
    """Rules about flag combinations that ServerArgs.check() does not cover."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.context_length is not None and args.context_length < 1:
        raise ValueError(f"--context-length must be >= 1, got {args.context_length}")
    if args.max_total_tokens is not None and args.max_total_tokens < args.page_size:
        raise ValueError(
            f"--max-total-tokens ({args.max_total_tokens}) must hold at least one page (--page-size {args.page_size})"
        )
    if args.hicache_ratio <= 1.0 and args.hicache_size <= 0 and args.enable_hierarchical_cache:
        raise ValueError(
            f"--hicache-ratio must be > 1 (the host tier has to be larger than the device pool), got {args.hicache_ratio}; "
            "or set --hicache-size in GB"
        )
    if args.hicache_size < 0:
        raise ValueError(f"--hicache-size must be >= 0 GB, got {args.hicache_size}")
    if args.hicache_storage_backend_extra_config and not args.hicache_storage_backend:
        raise ValueError("--hicache-storage-backend-extra-config needs --hicache-storage-backend")


def namespace_to_server_args(ns: argparse.Namespace) -> ServerArgs:
    """Map parsed flags onto ServerArgs (raises ValueError for a bad extra-config)."""
    values = vars(ns).copy()
    values["warmup"] = not values.pop("skip_warmup")
    accepted = dict(values.pop("accepted_sglang_flags"))
    for flag, (kwargs, reason) in ACCEPTED_SGLANG_FLAGS.items():
        value = values.pop(_dest(flag))
        if value != kwargs.get("default", False if kwargs.get("action") == "store_true" else None):
            accepted[flag] = reason if value is True else f"{value}: {reason}"
    values["accepted_sglang_flags"] = accepted
    values["dtype"] = {"half": "float16", "float": "float32"}.get(values["dtype"], values["dtype"])
    for parser_flag in ("reasoning_parser", "tool_call_parser"):
        if values[parser_flag] == "auto":  # SGLang's "detect from the chat template": tierlm's default
            values[parser_flag] = None
    if values["chunked_prefill_size"] == -1:  # SGLang: chunked prefill off; here a step takes max-prefill-tokens
        values["chunked_prefill_size"] = values["max_prefill_tokens"]
    values["hicache_storage_backend_extra_config"] = _load_extra_config(values["hicache_storage_backend_extra_config"])
    return ServerArgs(**values)


def parse_args(argv: Sequence[str] | None = None, prog: str = "tierlm serve") -> ServerArgs:
    """Parse flags into a checked ServerArgs. Bad values print the reason and exit with status 2."""
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    try:
        args = namespace_to_server_args(ns)
        _check_cli_only(args)
        args.check()
    except ValueError as e:
        parser.exit(2, f"{prog}: error: {e}\n")  # the message says what to change; no usage dump
    return args
