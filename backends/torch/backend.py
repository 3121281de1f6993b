"""TorchBackend: transformers modeling classes + tierlm's paged attention + batched sampling."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from tierlm.backends.base import (SHARED_PAGE_LAYOUT, ForwardBatch, ForwardOutput, HostKVPool, KVCacheDtypeError,
                                  ModelBackend, ModelInfo, SamplingBatch)
from tierlm.backends.dtypes import kv_storage_dtype
from tierlm.backends.model_source.fingerprint import model_fingerprint
from tierlm.backends.model_source.folder_facts import attention_shape
from tierlm.backends.model_source.model_folder import ModelFolder, as_model_folder
from tierlm.backends.torch import last_layer_rows, paged_attention
from tierlm.backends.torch.compile.compiled_decode import CompiledDecode
from tierlm.backends.torch.cpu import f32_gemv, huge_pages
from tierlm.backends.torch.cpu import plan as cpu_plan
from tierlm.backends.torch.cpu.linear import packed_bytes
from tierlm.backends.torch.cpu.threads import configure_cpu_threads
from tierlm.backends.torch.decode_graphs import DecodeGraphs
from tierlm.backends.torch.grammar_mask import apply_token_bitmask
from tierlm.backends.torch.kernel_report import kernel_report
from tierlm.backends.torch.kv_pool import KV_TORCH_DTYPES, TorchKVPool
from tierlm.backends.torch.linear_state import install_linear_state
from tierlm.backends.torch.logprobs import fill_logprobs, raw_logprobs
from tierlm.backends.torch.model_loader import load_model, resolve_dtype
from tierlm.backends.torch.sampler import row_argmax, sample
from tierlm.backends.torch.weights.mxfp4_experts import packed_bytes as mxfp4_packed_bytes
from tierlm.backends.torch.weights.quant_embedding import QuantizedEmbedding
from tierlm.backends.torch.weights.weight_quant import tensor_bytes
from tierlm.backends.verified_architectures import check_architecture
from tierlm.backends.weight_format import EMBEDDING_SUFFIX, WeightQuant, weight_format_label
from tierlm.platforms.cpu_plan import Choice
from tierlm.platforms.huge_pages import this_machine as huge_page_plan

log = logging.getLogger(__name__)


class TorchBackend(ModelBackend):
    name = "torch"
    page_layout = SHARED_PAGE_LAYOUT

    def __init__(self, model_dir: ModelFolder | str | Path, dtype: str = "auto", device: str = "cpu",
                 trust_remote_code: bool = False, seed: int = 0, trust_unverified_architecture: bool = False,
                 kv_cache_dtype: str = "auto", attention_backend: str = paged_attention.TORCH_NATIVE,
                 weight_quant: WeightQuant | None = None) -> None:
        """``kv_cache_dtype``: --kv-cache-dtype (auto, bf16, fp8_e4m3, fp8_e5m2): what KV pages are stored in.
        ``attention_backend``: "torch_native" (SDPA over gathered pages) or "triton" (triton_attention.py), as
        the composition root chose it. ``weight_quant``: --torchao-config / --quantization (weight_quant.py)."""
        folder = as_model_folder(model_dir)  # read once: the checks, EOS ids and the fingerprint share it
        self.model_dir = folder.path
        # Before any weights load: refuses (UnverifiedArchitectureError) what the reference tests do not verify.
        self.architecture_check = check_architecture(folder, self.name, trust_unverified_architecture,
                                                     trust_remote_code)
        if self.architecture_check.warning:
            log.warning(self.architecture_check.warning)
        self.torch_device = torch.device(device)
        self.device = self.torch_device.type
        self.dtype = resolve_dtype(dtype, self.torch_device)
        pages = None
        # On CPU, the execution plan (platforms/cpu_plan.py): which kernel each part of a step runs, decided here
        # from the CPU, the model's config and the kernel library, read by every CPU call site
        self.cpu_kernels: cpu_plan.CpuKernels | None = None
        if self.device == "cpu":
            threads = configure_cpu_threads()  # before any kernel runs: one core left to the server (threads.py)
            pages = huge_page_plan(os.environ)
            huge_pages.ask_at_allocation(pages)  # large weights born on huge pages (cpu/huge_pages.py)
            self.cpu_kernels = self._cpu_plan(folder, kv_cache_dtype, weight_quant, threads, pages)
        self.model = load_model(self.model_dir, self.dtype, self.torch_device, trust_remote_code, weight_quant,
                                self.cpu_kernels)
        # eager forwards: the last layer runs the rows whose logits are read (last_layer_rows.py)
        self.last_layer_rows = last_layer_rows.install(self.model)
        self.last_layer_read_rows = last_layer_rows.installed(self.model)
        # the rest of the weights moved there once packed: one core streams them ~1.3-1.8x faster
        self.huge_pages = huge_pages.place_model(self.model, pages) if pages is not None else None
        cfg = self.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        num_heads = self.num_heads = text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // num_heads
        self.info = ModelInfo(
            model_path=str(self.model_dir),
            architecture=(cfg.architectures or [type(self.model).__name__])[0],
            num_layers=text_cfg.num_hidden_layers,
            num_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=text_cfg.vocab_size,
            max_position_embeddings=getattr(text_cfg, "max_position_embeddings", 2048),
            eos_token_ids=folder.eos_token_ids,
            dtype=str(self.dtype).removeprefix("torch."),
            fingerprint=model_fingerprint(folder),
            sliding_window=getattr(text_cfg, "sliding_window", None),
            weight_format=self._weight_format(folder.config, weight_quant),
        )
        self.info.kv_dtype = kv_storage_dtype(kv_cache_dtype, self.info.dtype)
        self.kv_torch_dtype = KV_TORCH_DTYPES[self.info.kv_dtype]
        self.attention_backend = self._check_attention_backend(attention_backend)
        self.pool: TorchKVPool | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.compiled: CompiledDecode | None = None  # --enable-torch-compile (compile/compiled_decode.py)
        self.generator = torch.Generator(device=self.torch_device).manual_seed(seed)
        # Hybrids: linear mixers wrapped to read/write a state pool (linear_state.py); None otherwise.
        self.linear_state = install_linear_state(self.model, folder.text_config, self.info.dtype, self.torch_device)
        if self.linear_state is not None:
            self.info.state = self.linear_state.geometry

    def _cpu_plan(self, folder: ModelFolder, kv_cache_dtype: str, weight_quant: WeightQuant | None, threads: int,
                  pages) -> cpu_plan.CpuKernels:
        """The model's CPU plan from its config, before any weights load (logged, and in /server_info kernels)."""
        dtype = str(self.dtype).removeprefix("torch.")
        kv = KV_TORCH_DTYPES[kv_storage_dtype(kv_cache_dtype, dtype)]
        try:
            shape = attention_shape(folder.text_config)
        except (KeyError, TypeError, ZeroDivisionError):  # a config without attention heads: shape-free decisions
            shape = (0, 0, 0)
        kernels = cpu_plan.for_model(self.dtype, kv, *shape,
                                     weight_format_label(folder.config, weight_quant, self.device))
        plan = kernels.plan.with_decision("threads", Choice(str(threads), "torch's intra-op threads (cpu/threads.py)"))
        plan = plan.with_decision("huge_pages", Choice("yes" if pages.use else "no", pages.why))
        kernels = cpu_plan.CpuKernels(plan, kernels.lib)
        log.info("CPU plan: %s", "; ".join(f"{k} {v['value']}" for k, v in plan.to_dict().items()))
        return kernels

    def _weight_format(self, config, weight_quant: WeightQuant | None) -> str:
        """The label of the weights as loaded: "+embedding" only where the embedding really was quantized (it stays
        float when it is not a plain nn.Embedding or its rows do not fit the kernel), so L3 pages never mix."""
        label = weight_format_label(config, weight_quant, self.device)
        if label.endswith(EMBEDDING_SUFFIX) and \
                not any(isinstance(m, QuantizedEmbedding) for m in self.model.modules()):
            label = label.removesuffix(EMBEDDING_SUFFIX)
        return label

    def _check_attention_backend(self, name: str) -> str:
        if name == "tierlm_paged":  # torch_native's old name
            name = paged_attention.TORCH_NATIVE
        if name not in (paged_attention.TORCH_NATIVE, paged_attention.TRITON):
            raise ValueError(f"attention backend {name!r}: the torch backend has triton and torch_native")
        if name == paged_attention.TRITON:
            try:  # fails here, not at the first step
                from tierlm.backends.torch import triton_attention  # noqa: F401
            except ImportError as e:
                raise ImportError(f"--attention-backend triton: Triton does not import ({e}); use "
                                  "--attention-backend torch_native") from e

            fp8 = self.kv_torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            cc = torch.cuda.get_device_capability(self.torch_device) if self.torch_device.type == "cuda" else None
            if fp8 and cc is not None and cc < (8, 9):  # Triton converts fp8 in registers from sm_89 (Ada, Hopper)
                raise KVCacheDtypeError(
                    f"--kv-cache-dtype {self.info.kv_dtype} with --attention-backend triton needs a GPU with fp8 "
                    f"(compute capability 8.9+; this one is {cc[0]}.{cc[1]}): use --kv-cache-dtype bf16 or "
                    "--attention-backend torch_native")
        log.debug("torch attention: %s", name)
        return name

    # --- sizing ---
    def weight_bytes(self) -> int:
        return sum(tensor_bytes(p) for p in self.model.parameters()) + packed_bytes(self.model)

    def weight_bytes_per_token(self) -> int:
        """All the weights but an input embedding no other layer holds: a lookup reads one row of it (a tied one
        is read whole as the lm_head). As held: bf16-held or quantized weights at their size."""
        embedding = self.model.get_input_embeddings()
        if embedding is None:
            return self.weight_bytes()
        elsewhere = {id(p) for m in self.model.modules() if m is not embedding for p in m.parameters(recurse=False)}
        return self.weight_bytes() - sum(tensor_bytes(p) for p in embedding.parameters() if id(p) not in elsewhere)

    def init_kv_pool(self, num_pages: int, page_size: int) -> None:
        i = self.info
        # One page more than the runtime hands out: padded rows of static decode steps write there (decode_graphs).
        self.pool = TorchKVPool(i.num_layers, num_pages + 1, page_size, i.num_kv_heads, i.head_dim,
                                self.kv_torch_dtype, self.torch_device)
        self.scratch_page = num_pages
        self.decode_graphs = None

    def init_decode_graphs(self, max_bs: int, context_length: int, capture: bool) -> dict | None:
        assert self.pool is not None, "init_kv_pool() first"
        if self.linear_state is not None:
            return None  # hybrids: the recurrent-state reads and writes are not part of the static path
        capture = capture and self.device == "cuda" and self.attention_backend == paged_attention.TRITON
        if capture and mxfp4_packed_bytes(self.model):
            log.info("CUDA graphs: not captured: packed MXFP4 experts pick the experts to dequantize on the host "
                     "each step (TIERLM_MXFP4_EXPERTS=dequantized captures, at 2 bytes per expert weight)")
            capture = False
        self.decode_graphs = DecodeGraphs(self.pool, self.scratch_page, max_bs, context_length, self.info.vocab_size,
                                          self.torch_device, self.attention_backend, self._run_model, capture)
        return self.decode_graphs.info()

    def init_torch_compile(self, max_bs: int) -> dict:
        if self.linear_state is not None:
            raise ValueError("--enable-torch-compile: not available for hybrid models (their recurrent-state reads "
                             "and writes are not part of the compiled step); drop the flag")
        if self.decode_graphs is not None:
            raise ValueError("--enable-torch-compile with --cuda-graph-max-bs: on CPU that flag turns on the static "
                             "bucketed decode path, which would take the decode steps compiling is for; drop one")
        if self.device != "cpu":
            raise ValueError(f"--enable-torch-compile: implemented for the CPU; on {self.device} decode steps run "
                             "as captured CUDA graphs instead (the default); drop the flag")
        assert self.pool is not None, "init_kv_pool() first"
        self.compiled = CompiledDecode(self.model, max_bs, self.cpu_kernels)
        steps = self._compile_steps
        try:
            self.compiled.compile_now(steps)
        except ValueError as e:  # from tracing or inductor: a failed compile, not a precondition (those raise above)
            raise RuntimeError(f"{type(e).__name__}: {e}") from e
        return self.compiled.info()

    def _compile_steps(self) -> None:
        """A one-token step and a one-request two-token step on the scratch page, which no request owns (both of its
        page-table entries name it, so any page size holds the two positions): they compile the graph for one token
        and the symbolic one for several, whatever --torch-compile-max-bs allows."""
        ps, scratch = self.pool.page_size, self.scratch_page
        for n in (1, 2):  # ids unlike their positions: the direct call's check would see two inputs swapped
            self.forward(ForwardBatch(np.arange(3, 3 + n, dtype=np.int64) % self.info.vocab_size,
                                      np.arange(n, dtype=np.int64), np.asarray([n], np.int32),
                                      np.asarray([n], np.int32), np.full((1, 2), scratch, np.int32),
                                      np.asarray([n - 1], np.int64), SamplingBatch.greedy(1), ps))

    def torch_compile_stats(self) -> dict | None:
        return self.compiled.info() if self.compiled is not None else None

    def set_host_io_backend(self, mode: str) -> None:
        assert self.pool is not None, "init_kv_pool() first"
        self.pool.set_io_backend(mode)

    def decode_graph_stats(self) -> dict | None:
        return self.decode_graphs.info() if self.decode_graphs is not None else None

    def kernels(self) -> dict[str, str]:
        text_cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        report = kernel_report(self.model, self.device, self.dtype, self.kv_torch_dtype, self.attention_backend,
                               text_cfg.num_attention_heads, self.info.num_kv_heads, self.info.head_dim,
                               self.cpu_kernels)
        report["last_layer"] = self.last_layer_rows
        if self.huge_pages is not None:
            report["weight_pages"] = self.huge_pages.summary()
        return report

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                   read_rows_only: bool = False) -> torch.Tensor:
        """Logits [len(keep), V] float32. ``read_rows_only`` (eager steps): the last layer computes the ``keep`` rows
        alone (last_layer_rows.py) where it can and they are fewer than the step's tokens."""
        if keep.numel() == 0 and self.info.weight_format.startswith("torchao:"):
            # A step of prefill chunks only: torchao's dynamic activation quantization fails on an lm_head input
            # of 0 rows, so one row is computed and dropped.
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1)
            return out.logits[0, :0].float()
        if read_rows_only and self.last_layer_read_rows and keep.numel() < input_ids.shape[1]:
            with last_layer_rows.only(keep):  # the model's output is the keep rows, in order
                out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=0)
        else:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
        return out.logits[0].float()

    # --- execution ---
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        logits = self.forward_logits(batch)
        S = len(batch.sample_indices)
        lp = raw_logprobs(logits, batch)  # before sampling: no sampling transform reaches the logprobs
        tokens = self.sample(logits[:S], batch)
        out = ForwardOutput(next_token_ids=tokens.cpu().numpy().astype(np.int64))
        if lp is not None:
            fill_logprobs(out, lp, tokens, batch)
        return out

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model over the step; logits [S + P, V] float32 for batch.sample_indices, then
        batch.logprob_indices (the prompt rows scored for logprobs, when any)."""
        assert self.pool is not None, "init_kv_pool() first"
        self.pool.copies.before_forward()  # CUDA: this step's stream waits for pages still loading from L2
        if self.decode_graphs is not None and self.decode_graphs.accepts(batch):
            return self.decode_graphs.run(batch)
        dev = self.torch_device
        meta = paged_attention.StepMeta(batch.q_lens, batch.kv_lens, batch.positions, batch.page_table,
                                        batch.page_size, dev, self.attention_backend)
        input_ids = torch.from_numpy(batch.input_ids).to(dev)[None]
        positions = torch.from_numpy(batch.positions).to(dev)[None]
        rows = np.asarray(batch.sample_indices, np.int64)
        if batch.num_logprob_rows:
            rows = np.concatenate([rows, np.asarray(batch.logprob_indices, np.int64)])
        keep = torch.from_numpy(rows).to(dev)
        current = paged_attention.CURRENT
        current.meta, current.pool, current.kernels = meta, self.pool, self.cpu_kernels
        if self.linear_state is not None:
            self.linear_state.begin(batch)
        try:
            with f32_gemv.decode_step(meta.decode_rows is not None):  # float32 decode rows on its kernel
                if self.compiled is not None and self.compiled.accepts(batch):
                    with self.compiled.step(meta, self.pool, self.num_heads, self.info.head_dim, self.dtype):
                        return self.compiled.run(batch, lambda: self._run_model(input_ids, positions, keep))
                return self._run_model(input_ids, positions, keep, read_rows_only=True)
        finally:
            current.meta = current.kernels = None

    def sample(self, logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        s = batch.sampling
        logits = apply_token_bitmask(logits, s.token_bitmask)  # structured output: before every sampling step
        if s.all_greedy and not s.any_penalty and s.logit_bias is None:
            return row_argmax(logits)
        return sample(logits, s, self.generator)

    # --- tiers ---
    def copy_pages_to_host(self, device_pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
        self.pool.to_host(np.asarray(device_pages), host, np.asarray(host_pages))

    def copy_pages_from_host(self, host: HostKVPool, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        self.pool.from_host(host, np.asarray(host_pages), np.asarray(device_pages))
