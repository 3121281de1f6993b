"""ServerArgs: every launch setting in one typed record, shared by the server, runtime and backends.

Names follow SGLang's flags (``--model-path`` -> ``model_path``) so SGLang commands run unchanged.
Parsing from the command line lives in ``server/commands/cli_args.py``; this file only holds and checks values. The
record is frozen: what the engine decides at startup (the chat format, the backend, the pool sizes) lives in its own
records, never written back into the launch settings.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from tierlm.runtime.cache.storage import registry as storage_registry

# --attention-backend values: tierlm's attention implementations, and the backend each one belongs to. torch:
# triton (kernels reading KV pages in place; CUDA), torch_native (SDPA over gathered pages; the reference);
# tierlm_paged: the old name of torch_native, still accepted (ATTENTION_ALIASES).
ATTENTION_BACKENDS = {"triton": "torch", "torch_native": "torch", "tierlm_paged": "torch", "mlx_paged": "mlx"}
ATTENTION_ALIASES = {"tierlm_paged": "torch_native"}
# --kv-cache-dtype values (SGLang's names) tierlm stores KV pages in; "auto" is the model's dtype.
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
# Load-time weight quantization names, checked here so the CLI refuses a typo at once; the parser and the device
# checks are backends/weight_format.py (runtime may not import it; tests/test_weight_quant.py keeps them equal).
QUANTIZATION_NAMES = r"w8a8_int8|fp8|q[48](-g(32|64|128))?"
TORCHAO_CONFIG_NAMES = r"int8wo|int8dq|int4wo-(32|64|128|256)|fp8wo|fp8dq-per_row"
# --schedule-policy values: the order waiting requests are admitted in (runtime/schedule_policy.py).
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "random", "lof")
# --radix-eviction-policy values: which unlocked cache pages go first when a tier (device or host) is full
# (runtime/cache/eviction_policy.py).
RADIX_EVICTION_POLICIES = ("lru", "lfu", "slru", "loop")
# --speculative-algorithm values tierlm implements (runtime/speculative/); SGLang's others are refused.
SPECULATIVE_ALGORITHMS = ("NGRAM",)
NGRAM_MATCH_TYPES = ("BFS", "PROB")
# The name of the model served without --model-path (backends/model_source/builtin_model.py has its files;
# runtime/ may not import that, tests/test_builtin_model.py holds the two names equal)
BUILTIN_MODEL_NAME = "stories260K"


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = None  # None -> the built-in model (backends/model_source/builtin_model.py)
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    context_length: int | None = None  # None -> the model's max_position_embeddings
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | mps (mps: MLX on Apple Silicon)
    backend: str | None = None  # torch | mlx, set in code (tests, embedders); None: TIERLM_BACKEND or the machine
    trust_remote_code: bool = False
    trust_unverified_architecture: bool = False  # serve an architecture the reference tests do not cover
    chat_template: str | None = None  # a jinja file, inline template or built-in name; None: the model's own
    trust_request_chat_template: bool = False  # a request may send its own chat_template (vLLM's flag)
    reasoning_parser: str | None = None  # None: chosen from the model when unambiguous (gpt-oss, qwen3)
    tool_call_parser: str | None = None  # None: chosen from the model when unambiguous (qwen25, llama3, mistral, gpt-oss)
    # http
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None  # admin routes (flush_cache) need this key when set
    allowed_origins: list[str] = dataclasses.field(default_factory=list)  # extra Origin/Host values to accept
    max_request_bytes: int = 8 * 2**20  # larger bodies get 413 before they are parsed
    log_level: str = "info"
    log_requests: bool = False  # also log each request's prompt and output text
    keep_anthropic_billing_header: bool = False  # keep Claude Code's per-prompt billing block in the prompt
    # scheduling
    max_running_requests: int = 32
    max_total_tokens: int | None = None  # cap on device KV tokens
    page_size: int = 16
    chunked_prefill_size: int = 2048
    mem_fraction_static: float | None = None  # share of free memory given to weights + KV pool
    disable_radix_cache: bool = False
    cache_pin_fraction: float = 0.5  # share of each cache tier prompt-caching pins may hold (runtime/cache/pins.py)
    # hierarchical cache (HiCache), SGLang names and defaults
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0  # GB; >0 overrides the ratio
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "page_first"
    hicache_io_backend: str = "kernel"
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend_extra_config: str | None = None
    # misc
    random_seed: int = 0
    grammar_backend: str = "xgrammar"  # structured output: xgrammar | none (every grammar is refused)
    grammar_compile_timeout: float = 10.0  # seconds; a grammar compiling longer fails its requests with a 400
    grammar_cache_mb: int = 256  # compiled grammars kept, by their memory (LRU)
    warmup: bool = True
    # SGLang compatibility (docs/sglang-compat.md): each one works, is accepted and logged, or is refused in check()
    revision: str | None = None  # hub branch, tag or commit of --model-path
    download_dir: str | None = None  # hub cache folder for --model-path (default: the standard HF cache)
    quantization: str | None = None  # load-time weight quantization (backends/weight_format.py): w8a8_int8, fp8, q4, q8
    torchao_config: str | None = None  # torch: torchao's quantize_ at load (int8wo, int8dq, int4wo-<group>, fp8*)
    kv_cache_dtype: str = "auto"  # KV pages in every tier: auto (the model's dtype), bf16, fp8_e4m3, fp8_e5m2
    attention_backend: str | None = None  # None: the chosen backend's own; else one of ATTENTION_BACKENDS
    max_prefill_tokens: int = 16384  # prompt tokens in one step's prefill (the budget is min with chunked_prefill_size)
    stream_interval: int = 1  # streaming: one increment every N generated tokens (and the first, and the last)
    max_queued_requests: int | None = None  # waiting requests beyond this get 503; None: unbounded
    schedule_policy: str = "fcfs"  # admission order of waiting requests: fcfs, lpm, dfs-weight, random, lof
    watchdog_timeout: float = 300.0  # a model step running longer marks the server unhealthy (error log, 503s)
    tp_size: int = 1  # tensor parallelism: only 1
    dp_size: int = 1  # data parallelism: only 1 (several instances behind sglang-router instead)
    disable_cuda_graph: bool = False  # CUDA: decode steps eager instead of captured (backends/torch/decode_graphs.py)
    cuda_graph_max_bs: int | None = None  # largest captured decode batch; on CPU: the static path without capture
    # CPU: decode steps (and steps of <= 32 tokens) of up to torch_compile_max_bs requests run through torch.compile
    # (backends/torch/compile/compiled_decode.py)
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    enable_metrics: bool = False  # accepted: /metrics is always on
    enable_cache_report: bool = False  # accepted: usage always reports cached_tokens
    # lru | lfu | slru | loop: eviction order of unlocked pages in the device and host tiers; loop (tierlm's own,
    # SGLang's default is lru) keeps part of a reuse cycle larger than the host tier (docs/performance.md)
    radix_eviction_policy: str = "loop"
    # speculative decoding (runtime/speculative/): NGRAM drafts verified in the scheduler's batch, SGLang's flags
    speculative_algorithm: str | None = None  # None | NGRAM (EAGLE, EAGLE3, NEXTN, STANDALONE are refused)
    speculative_num_draft_tokens: int | None = None  # positions verified per step, the current token included;
    # None -> --speculative-ngram-max-match-window-size (SGLang's rule)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 1  # tierlm verifies one chain of drafts: only 1 (SGLang: 10, a tree)
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 10 * 1000 * 1000
    # SGLang flags given with nothing to change in tierlm (server/commands/cli_args.py ACCEPTED_SGLANG_FLAGS and the
    # neutral values of refused ones): flag -> what was given and why nothing changes; logged at startup
    accepted_sglang_flags: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_algorithm, str) and self.speculative_algorithm.upper() == "NGRAM":
            object.__setattr__(self, "speculative_algorithm", "NGRAM")  # the flag's spelling is free (SGLang's rule)

    @property
    def model_name(self) -> str:
        """The name clients see in /v1/models and in responses."""
        if self.served_model_name:
            return self.served_model_name
        return self.model_path or BUILTIN_MODEL_NAME

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key"):
            if d.get(secret):
                d[secret] = "***"
        return d

    def check(self) -> None:
        """Raise ValueError with an actionable message when settings contradict each other."""
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be at least --page-size ({self.page_size})"
            )
        if self.grammar_backend in ("outlines", "llguidance"):
            raise ValueError(f"--grammar-backend {self.grammar_backend}: not available in tierlm; use xgrammar (the "
                             "default) or none")
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError(f"--grammar-backend must be xgrammar or none, got {self.grammar_backend!r}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if self.grammar_cache_mb < 0:
            raise ValueError(f"--grammar-cache-mb must be >= 0, got {self.grammar_cache_mb}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError(
                "--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache "
                "(the host and storage tiers live under the radix tree)"
            )
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if not 0.0 <= self.cache_pin_fraction <= 1.0:  # NaN fails too
            raise ValueError(f"--cache-pin-fraction must be between 0 and 1 (0: no pins), got "
                             f"{self.cache_pin_fraction}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.hicache_storage_backend:
            storage_registry.check_name(self.hicache_storage_backend)
            if not self.enable_hierarchical_cache:
                raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache (storage is the third "
                                 "tier)")
        self._check_sglang_compat()

    def _check_sglang_compat(self) -> None:
        """SGLang flags tierlm cannot honour stop startup with the reason and what to use instead
        (docs/sglang-compat.md lists every flag)."""
        if self.tp_size != 1 or self.dp_size != 1:
            flag = "--tp-size" if self.tp_size != 1 else "--dp-size"
            value = self.tp_size if self.tp_size != 1 else self.dp_size
            raise ValueError(f"{flag} {value}: tierlm runs one model copy on one device (only 1 works); to use "
                             "several devices start one tierlm instance per device and put sglang-router in front "
                             "(docs/scale-out.md)")
        if self.quantization is not None and self.torchao_config is not None:
            raise ValueError(f"--quantization {self.quantization} and --torchao-config {self.torchao_config}: pass "
                             "one of them")
        if self.quantization is not None and not re.fullmatch(QUANTIZATION_NAMES, self.quantization):
            raise ValueError(f"--quantization {self.quantization}: use w8a8_int8 or fp8 (torch backend, torchao), "
                             "q4 or q8 with an optional -g32|-g64|-g128 group (mlx backend), or --torchao-config")
        if self.torchao_config is not None and not re.fullmatch(TORCHAO_CONFIG_NAMES, self.torchao_config):
            raise ValueError(f"--torchao-config {self.torchao_config}: use int8wo, int8dq, int4wo-<group> (32, 64, "
                             "128, 256), fp8wo or fp8dq-per_row")
        if self.kv_cache_dtype == "fp4_e2m1":
            raise ValueError("--kv-cache-dtype fp4_e2m1: FP4 KV pages are not implemented; use fp8_e4m3 (half the "
                             "bytes of bf16) or auto")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.schedule_policy == "priority":
            raise ValueError("--schedule-policy priority: request priorities are not implemented; use lpm (cache "
                             "aware) or fcfs")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy {self.schedule_policy}: use one of {', '.join(SCHEDULE_POLICIES)}")
        if self.radix_eviction_policy not in RADIX_EVICTION_POLICIES:
            raise ValueError(f"--radix-eviction-policy {self.radix_eviction_policy}: use one of "
                             f"{', '.join(RADIX_EVICTION_POLICIES)}")
        self._check_speculative()
        if self.attention_backend == "flashinfer":
            raise ValueError("--attention-backend flashinfer: not implemented in tierlm; use triton (CUDA: kernels "
                             "that read KV pages in place) or torch_native, or drop the flag to get the default")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            names = ", ".join(f"{n} ({b} backend)" for n, b in ATTENTION_BACKENDS.items())
            raise ValueError(f"--attention-backend {self.attention_backend}: not an attention implementation of "
                             f"tierlm; use one of {names}, or drop the flag to get the chosen backend's own")
        if self.max_prefill_tokens < self.page_size:
            raise ValueError(f"--max-prefill-tokens ({self.max_prefill_tokens}) must be at least --page-size "
                             f"({self.page_size})")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if self.torch_compile_max_bs < 1:
            raise ValueError(f"--torch-compile-max-bs must be >= 1, got {self.torch_compile_max_bs}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")

    @property
    def num_draft_tokens(self) -> int:
        """Positions one verify step runs per request (the current token and its drafts): SGLang's default is the
        longest match window."""
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens
        return self.speculative_ngram_max_match_window_size

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        if algo.upper() != "NGRAM":
            raise ValueError(f"--speculative-algorithm {algo}: tierlm implements NGRAM only (drafts looked up in the "
                             "tokens already seen, no draft model); EAGLE, EAGLE3, NEXTN and STANDALONE need a draft "
                             "model tierlm cannot run yet")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"--speculative-ngram-min-match-window-size ({lo}) and -max- ({hi}) must satisfy "
                             "1 <= min <= max")
        if self.speculative_ngram_min_bfs_breadth != 1 or self.speculative_ngram_max_bfs_breadth != 1:
            raise ValueError("--speculative-ngram-min/max-bfs-breadth: tierlm verifies one chain of draft tokens per "
                             "request (a tree of breadth 1), so both must be 1 (SGLang's default max is 10: drop the "
                             "flag or pass 1)")
        if self.speculative_ngram_match_type not in NGRAM_MATCH_TYPES:
            raise ValueError(f"--speculative-ngram-match-type must be BFS or PROB, got "
                             f"{self.speculative_ngram_match_type!r}")
        if self.num_draft_tokens < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 (the current token and at least one "
                             f"draft), got {self.num_draft_tokens}")
        if self.speculative_ngram_branch_length < 1:
            raise ValueError(f"--speculative-ngram-branch-length must be >= 1, got "
                             f"{self.speculative_ngram_branch_length}")
        if self.speculative_ngram_capacity < 1:
            raise ValueError(f"--speculative-ngram-capacity must be >= 1, got {self.speculative_ngram_capacity}")
