"""ServerArgs: every launch setting in one typed record, shared by the server, runtime and backends.

Names follow SGLang's flags (``--model-path`` -> ``model_path``) so SGLang commands run unchanged.
Parsing from the command line lives in ``server/cli_args.py``; this file only holds and checks values.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ServerArgs:
    # model
    model_path: str | None = None  # None -> the built-in demo model
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    context_length: int | None = None  # None -> the model's max_position_embeddings
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | mps (mps: MLX on Apple Silicon)
    trust_remote_code: bool = False
    trust_unverified_architecture: bool = False  # serve an architecture the reference tests do not cover
    chat_template: str | None = None  # a jinja file, inline template or built-in name; None: the model's own
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
    # scheduling
    max_running_requests: int = 32
    max_total_tokens: int | None = None  # cap on device KV tokens
    page_size: int = 16
    chunked_prefill_size: int = 2048
    mem_fraction_static: float | None = None  # share of free memory given to weights + KV pool
    disable_radix_cache: bool = False
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
    warmup: bool = True

    @property
    def model_name(self) -> str:
        """The name clients see in /v1/models and in responses."""
        if self.served_model_name:
            return self.served_model_name
        return self.model_path or "tierlm-demo"

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
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ValueError(f"--grammar-backend must be xgrammar or none, got {self.grammar_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError(
                "--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache "
                "(the host and storage tiers live under the radix tree)"
            )
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
