"""MLXBackend: mlx-lm model classes + tierlm's paged attention + the mlx sampler, behind the backend contract."""
from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from tierlm.backends.base import (SHARED_PAGE_LAYOUT, ForwardBatch, ForwardOutput, HostKVPool, KVCacheDtypeError,
                                  ModelBackend, ModelInfo)
from tierlm.backends.dtypes import kv_storage_dtype
from tierlm.backends.mlx.grammar_mask import apply_token_bitmask
from tierlm.backends.mlx.hybrid_families import ModelParts, attention_attributes
from tierlm.backends.mlx.kv_pool import MLXKVPool
from tierlm.backends.mlx.linear_state import LinearState, install_linear_state
from tierlm.backends.mlx.linear_state import StepPlan as LinearStepPlan
from tierlm.backends.mlx.logprobs import fill_logprobs, raw_logprobs
from tierlm.backends.mlx.model_loader import load_mlx_model
from tierlm.backends.mlx.paged_attention import StepContext, StepPlan, install_paged_attention, sliding_windows
from tierlm.backends.mlx.sampler import sample
from tierlm.backends.model_source.fingerprint import model_fingerprint
from tierlm.backends.model_source.hybrid_layout import hybrid_layout
from tierlm.backends.model_source.model_folder import ModelFolder, as_model_folder
from tierlm.backends.verified_architectures import check_architecture
from tierlm.backends.weight_format import WeightQuant, weight_format_label

log = logging.getLogger(__name__)

DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}
MLX_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3")  # --kv-cache-dtype values this backend stores


class MLXBackend(ModelBackend):
    name = "mlx"
    page_layout = SHARED_PAGE_LAYOUT

    def __init__(self, model_dir: ModelFolder | str | Path, dtype: str = "float32", seed: int = 0,
                 device: str | None = None, trust_unverified_architecture: bool = False,
                 kv_cache_dtype: str = "auto", weight_quant: WeightQuant | None = None) -> None:
        """``device``: "cpu" pins MLX to the CPU (e.g. SGLANG_USE_MLX=1 --device cpu on a Mac); None keeps
        MLX's default (the Metal GPU where there is one). ``trust_unverified_architecture``: load an architecture
        outside backends/verified_architectures.py anyway (with a warning) instead of refusing it.
        ``kv_cache_dtype``: --kv-cache-dtype (auto, bf16, fp8_e4m3); fp8_e5m2 is a KVCacheDtypeError (MLX has
        no e5m2 cast), raised before any weights load. ``weight_quant``: --quantization q4|q8 (weight_quant.py)."""
        if kv_cache_dtype not in MLX_KV_CACHE_DTYPES:
            raise KVCacheDtypeError(
                f"--kv-cache-dtype {kv_cache_dtype} is not available on the mlx backend (MLX casts to fp8 only in "
                f"the e4m3 format); use --kv-cache-dtype fp8_e4m3 (the same 1 byte per value) or auto")
        folder = as_model_folder(model_dir)  # read once: the checks, the loader, EOS ids and the fingerprint share it
        # Before mlx-lm sees the folder: refuses (UnverifiedArchitectureError) what the reference tests do not verify.
        self.architecture_check = check_architecture(folder, self.name, trust_unverified_architecture)
        if self.architecture_check.warning:
            log.warning(self.architecture_check.warning)
        if device == "cpu":
            mx.set_default_device(mx.cpu)
        self.model_dir = folder.path
        self.model, config, self.dtype = load_mlx_model(folder, dtype, weight_quant)
        self.device = "metal" if mx.default_device() == mx.gpu else "cpu"
        self._weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        if not (hasattr(self.model, "model") or hasattr(self.model, "backbone")):
            raise NotImplementedError(
                f"{type(self.model).__module__}.Model has no .model body; the mlx backend supports decoder "
                "families laid out like llama, mistral, qwen2 and qwen3, and the verified hybrids")
        self.parts = ModelParts(self.model)
        layers = self.parts.layers
        num_layers = len(layers)
        windows = sliding_windows(config, num_layers)
        self._ctx = StepContext()
        layout = hybrid_layout(config)
        attention = attention_attributes(layout, num_layers)
        install_paged_attention(self.model, self._ctx, windows, layers, attention)
        # Hybrids: linear mixers wrapped to read/write a state pool (linear_state.py); None otherwise.
        self.linear_state: LinearState | None = None
        if layout is not None:
            self.linear_state = install_linear_state(layers, layout, DTYPE_NAMES[self.dtype])

        num_heads = config["num_attention_heads"]
        first = min(attention)
        attn = getattr(layers[first], attention[first]).inner
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        self.info = ModelInfo(
            model_path=str(self.model_dir),
            architecture=(config.get("architectures") or [config.get("model_type", "unknown")])[0],
            num_layers=num_layers,
            num_kv_heads=getattr(attn, "n_kv_heads", None) or config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings") or 2048,
            eos_token_ids=folder.eos_token_ids,
            dtype=DTYPE_NAMES[self.dtype],
            fingerprint=model_fingerprint(folder),
            sliding_window=next((w for w in windows if w is not None), None),
            kv_dtype=kv_storage_dtype(kv_cache_dtype, DTYPE_NAMES[self.dtype]),
            state=self.linear_state.geometry if self.linear_state is not None else None,
            weight_format=weight_format_label(folder.config, weight_quant),
        )
        self.pool: MLXKVPool | None = None
        self._key = mx.random.key(seed)
        log.info("mlx backend: %s, %d layers, %s on %s, %.1f MiB of weights", self.info.architecture,
                 num_layers, self.info.dtype, self.device, self._weight_bytes / 2**20)

    # --- sizing ---
    def weight_bytes(self) -> int:
        return self._weight_bytes

    def _arrays(self) -> list[mx.array]:
        """What a step writes: the KV pool, and a hybrid's state pool."""
        return self.pool.arrays() + (self.linear_state.arrays() if self.linear_state is not None else [])

    def init_kv_pool(self, num_pages: int, page_size: int) -> None:
        i = self.info
        fp8 = i.kv_dtype == "fp8_e4m3"
        kv_dtype = self.dtype if fp8 else {v: k for k, v in DTYPE_NAMES.items()}[i.kv_dtype]
        self.pool = MLXKVPool(i.num_layers, num_pages, page_size, i.num_kv_heads, i.head_dim, kv_dtype, fp8=fp8)
        self._ctx.pool = self.pool

    # --- execution ---
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        logits = self.forward_logits(batch)
        if logits is None:
            mx.eval(self._arrays())
            return ForwardOutput(next_token_ids=np.zeros(0, np.int64))
        S = len(batch.sample_indices)
        lp = raw_logprobs(logits, batch)  # before sampling: no sampling transform reaches the logprobs
        tokens = self.sample(logits[:S], batch) if S else mx.zeros((0,), mx.int64)
        mx.eval(tokens, self._arrays())
        out = ForwardOutput(next_token_ids=np.array(tokens).astype(np.int64))
        if lp is not None:
            fill_logprobs(out, lp, tokens, batch)
        return out

    def forward_logits(self, batch: ForwardBatch) -> mx.array | None:
        """Run the model over the step (lazily); float32 logits [S + P, V] of batch.sample_indices then
        batch.logprob_indices (prompt rows scored for logprobs), None if S + P == 0."""
        if self.pool is None:
            raise RuntimeError("call init_kv_pool(num_pages, page_size) before forward()")
        if batch.page_size != self.pool.page_size:
            raise ValueError(f"batch.page_size {batch.page_size} differs from the pool's {self.pool.page_size}")
        self._ctx.plan = StepPlan(batch)
        if self.linear_state is not None:
            self.linear_state.plan = LinearStepPlan(batch)
        try:
            # the decoder body (embeddings .. final norm); the head runs on sampled rows only.
            hidden = self.parts.body(mx.array(np.asarray(batch.input_ids, np.int32))[None])[0]
        finally:
            self._ctx.plan = None  # the lazy graph already holds every index array it needs
            if self.linear_state is not None:
                self.linear_state.plan = None
        rows = np.asarray(batch.sample_indices, np.int32)
        if batch.num_logprob_rows:
            rows = np.concatenate([rows, np.asarray(batch.logprob_indices, np.int32)])
        if len(rows) == 0:
            return None
        hidden = hidden[mx.array(rows)]
        return self.parts.head(hidden).astype(mx.float32)

    def sample(self, logits: mx.array, batch: ForwardBatch) -> mx.array:
        s = batch.sampling
        logits = apply_token_bitmask(logits, s.token_bitmask)  # structured output: before every sampling step
        if s.all_greedy and not s.any_penalty and s.logit_bias is None:
            return mx.argmax(logits, axis=-1)
        self._key, step_key = mx.random.split(self._key)
        return sample(logits, s, key=step_key)

    # --- tiers ---
    def copy_pages_to_host(self, device_pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
        self._require_pool().to_host(np.asarray(device_pages), host, np.asarray(host_pages))

    def copy_pages_from_host(self, host: HostKVPool, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        self._require_pool().from_host(host, np.asarray(host_pages), np.asarray(device_pages))

    def _require_pool(self) -> MLXKVPool:
        if self.pool is None:
            raise RuntimeError("call init_kv_pool(num_pages, page_size) before copying pages")
        return self.pool
