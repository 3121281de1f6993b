"""The contract between the runtime (requests, scheduler, caches) and a backend (tensors).

The runtime describes one scheduler step as a ``ForwardBatch`` of plain numpy arrays; a backend runs the
model once over it (prefill chunks and decode tokens mixed), writes the new K/V into the device KV pool at the
pages the runtime assigned, samples the next token of every request that needs one and returns the ids.
Page *indices* are runtime bookkeeping; page *contents* belong to the backend. Moving a page between tiers
(device <-> host) is a backend call because only the backend can touch the device pool.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from tierlm.backends.dtypes import DTYPE_BYTES, kv_bytes_per_token
from tierlm.backends.host_memory import allocate_host_bytes
from tierlm.backends.model_source.model_folder import ModelFolder
from tierlm.backends.weight_format import WeightQuant
from tierlm.platforms.cpu_features import CpuFeatures

T = TypeVar("T")


@dataclass(frozen=True)
class Choice(Generic[T]):
    """One decision of a load plan (runtime/load_plan.py): its value and why, as startup logs it and `tierlm doctor`
    prints it."""

    value: T
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "why": self.why}


@dataclass(frozen=True)
class PlanFacts:
    """What a backend plans its part of a load from, before anything is loaded: the model folder (config.json and
    the safetensors headers), the device, and the flags that are the backend's business."""

    folder: ModelFolder
    device: str
    dtype: str  # --dtype as given ("auto" included)
    kv_cache_dtype: str  # --kv-cache-dtype as given
    native_bf16: bool  # the platform decision's fact: this CPU has native bf16 matmuls (torch)
    quant: WeightQuant | None  # --quantization / --torchao-config, parsed
    env: Mapping[str, str]
    architecture: str = ""  # config.json's architecture, as the architecture check read it
    compute_capability: tuple[int, int] | None = None  # CUDA only
    enable_torch_compile: bool = False
    static_decode: bool = False  # --cuda-graph-max-bs: decode steps on the static bucketed path
    cpu: CpuFeatures | None = None  # the machine facts' CPU (None: this process's CPU)


@dataclass(frozen=True)
class ServedSizes:
    """A model as a backend will hold it, counted from the folder alone: what the memory plan sizes the KV tiers
    from, before the weights load (the builder checks them against the loaded backend)."""

    dtype: str
    kv_dtype: str
    weight_format: str  # as /server_info reports it (backends/weight_format.py)
    weight_bytes: int
    kv_bytes_per_token: int
    state_slot_bytes: int = 0  # hybrids: one request's recurrent state
    vocab_size: int | None = None
    attention_heads: tuple[int, int, int] = (0, 0, 0)  # (heads, KV heads, head size)
    notes: dict[str, Any] = field(default_factory=dict)  # e.g. how gpt-oss experts are held

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "kv_cache_dtype": self.kv_dtype, "weight_format": self.weight_format,
                "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_slot_bytes": self.state_slot_bytes, "vocab_size": self.vocab_size,
                "attention_heads": list(self.attention_heads), **self.notes}


@dataclass(frozen=True)
class BackendPlan:
    """A backend's part of the load plan: each choice with its reason. The builder (runtime/engine_setup.py) hands
    ``dtype`` to the backend and runs ``compile``; doctor prints all of it. Made by the backend's ``plan_load``
    (backends/torch/load_plan.py, backends/mlx/load_plan.py), which imports no tensor library."""

    dtype: Choice[str]
    sizes: ServedSizes | None  # None: the folder's config has not the usual fields (``sizes_why`` says which)
    compile: Choice[bool]  # compile the decode step before serving (torch on CPU by default; the flag anywhere)
    kernels: dict[str, Choice[str]] | None = None  # torch on CPU: the execution plan (platforms/cpu_plan.py)
    sizes_why: str = ""
    refusal: str = ""  # why this backend cannot load the model so (a CPU plan override this CPU cannot run)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype.to_dict(), "sizes": self.sizes.to_dict() if self.sizes else None,
                "compile": self.compile.to_dict(),
                "kernels": {k: c.to_dict() for k, c in self.kernels.items()} if self.kernels is not None else None}


@dataclass(frozen=True)
class StateGeometry:
    """The per-request recurrent state of a hybrid model's linear layers (backends/model_source/hybrid_layout.py):
    per linear layer a conv state ``[conv_dim, conv_kernel]`` in ``conv_dtype`` and a recurrent state ``rec_shape``
    in ``rec_dtype``. One *slot* holds one request's state of every linear layer."""

    num_linear_layers: int
    conv_dim: int
    conv_kernel: int
    rec_shape: tuple[int, ...]
    conv_dtype: str  # the model's dtype
    rec_dtype: str = "float32"

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot (conv with all K columns, as transformers keeps it, plus the recurrent state;
        mlx-lm keeps K-1 columns, so on MLX this over-counts a little)."""
        rec = 1
        for d in self.rec_shape:
            rec *= d
        per_layer = self.conv_dim * self.conv_kernel * DTYPE_BYTES[self.conv_dtype] + rec * DTYPE_BYTES[self.rec_dtype]
        return self.num_linear_layers * per_layer


@dataclass
class ModelInfo:
    """What the runtime needs to know about a loaded model, backend-neutral."""

    model_path: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    dtype: str  # "float32" | "bfloat16" | "float16"
    fingerprint: str  # sha256 of config bytes + weight names/sizes/sampled content (model_source/fingerprint.py)
    sliding_window: int | None = None
    # What KV pages are stored in (--kv-cache-dtype through dtypes.kv_storage_dtype): the model's dtype, "bfloat16",
    # "fp8_e4m3" or "fp8_e5m2". Empty: the model's dtype. Every tier (device, host, file) holds pages in it.
    kv_dtype: str = ""
    # Hybrids (linear-attention / Mamba layers): the recurrent state of one request; None for attention-only models.
    state: StateGeometry | None = None
    # The weights' format (backends/weight_format.py): "none", "torchao:int8wo", "mlx:q4-g64", "checkpoint:mxfp4".
    weight_format: str = "none"

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            self.kv_dtype = self.dtype


@dataclass
class SamplingBatch:
    """Sampling settings of the S requests that sample a token this step, one entry per request, in order."""

    temperature: np.ndarray  # float32 [S]; 0 -> greedy
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S]; -1 -> off
    min_p: np.ndarray  # float32 [S]
    presence_penalty: np.ndarray  # float32 [S]
    frequency_penalty: np.ndarray  # float32 [S]
    repetition_penalty: np.ndarray  # float32 [S]
    seeds: list[int | None]  # per-request seed; None -> the backend's global generator
    output_ids: list[Sequence[int]]  # tokens generated so far (presence/frequency penalties, seeded step index)
    prompt_ids: list[Sequence[int]]  # prompt tokens (repetition penalty counts prompt + output, as HF does)
    all_greedy: bool
    any_penalty: bool
    # Structured output: xgrammar's packed allowed-token bitmask, int32 [S, ceil(V / 32)] (bit j of word w allows
    # token 32 * w + j), or None when no row is constrained; an unconstrained row is all ones (-1). The samplers
    # mask the logits with it before penalties, temperature, top-k/p and min-p, and before the greedy argmax.
    token_bitmask: np.ndarray | None = None
    # logit_bias of every row that has one, as (rows int64 [B], token ids int64 [B], biases float32 [B]); None when
    # no row has one. The samplers add it to the logits first: before penalties, temperature and the greedy argmax.
    logit_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def greedy(cls, n: int) -> "SamplingBatch":
        """A batch of n greedy requests (tests, warm-up)."""
        return cls(
            temperature=np.zeros(n, np.float32), top_p=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            min_p=np.zeros(n, np.float32), presence_penalty=np.zeros(n, np.float32),
            frequency_penalty=np.zeros(n, np.float32), repetition_penalty=np.ones(n, np.float32),
            seeds=[None] * n, output_ids=[[] for _ in range(n)], prompt_ids=[[] for _ in range(n)],
            all_greedy=True, any_penalty=False,
        )


def active_filters(top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray, vocab: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows where top_k, top_p and min_p each change anything, or None when no row filters (then the samplers
    skip sorting the vocabulary)."""
    topk_on = (top_k > 0) & (top_k < vocab)
    topp_on = top_p < 1.0
    minp_on = min_p > 0.0
    if not (topk_on.any() or topp_on.any() or minp_on.any()):
        return None
    return topk_on, topp_on, minp_on


@dataclass
class ForwardBatch:
    """One scheduler step, flattened: the new tokens of R requests laid end to end (T tokens in all).

    Request r contributes ``q_lens[r]`` new tokens at positions ``kv_lens[r]-q_lens[r] .. kv_lens[r]-1``;
    its K/V for positions < kv_lens[r] live in pages ``page_table[r, :ceil(kv_lens[r]/page_size)]``
    (position p -> page ``page_table[r, p // page_size]``, offset ``p % page_size``). The backend writes
    the K/V of the new tokens there and attends causally over positions 0..p for a token at position p.
    """

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    q_lens: np.ndarray  # int32 [R]
    kv_lens: np.ndarray  # int32 [R]
    page_table: np.ndarray  # int32 [R, max_pages], padded with 0
    sample_indices: np.ndarray  # int64 [S]: rows of the flattened tokens whose logits are sampled
    sampling: SamplingBatch
    page_size: int
    # Log-probabilities (docs/logprobs.md). The defaults ask for none, and then a backend computes none.
    sample_logprobs: bool = False  # return the logprobs of the S sampled rows (ForwardOutput.logprobs, top_*)
    logprob_top_k: int = 0  # K: top entries per scored row (the step's largest request, 0..MAX_TOP_LOGPROBS)
    logprob_indices: np.ndarray | None = None  # int64 [P]: extra rows (prompt positions) scored, never sampled
    logprob_targets: np.ndarray | None = None  # int64 [P]: the token each of those rows is scored on
    # Hybrids (ModelInfo.state set): each request's state slot, int32 [R]. A request with kv_lens == q_lens starts
    # from a zero state; any other continues from the state its slot holds. None for attention-only models.
    state_slots: np.ndarray | None = None
    # Hybrids, prefix reuse: after ``snapshot_at[r]`` of request r's new tokens (1..q_len; -1: none) the backend
    # copies r's state into slot ``snapshot_dst[r]`` (a page-aligned snapshot; a prefill segment is split there
    # when the point falls inside it). None when no request of the step takes one.
    snapshot_at: np.ndarray | None = None
    snapshot_dst: np.ndarray | None = None

    @property
    def num_logprob_rows(self) -> int:
        return 0 if self.logprob_indices is None else len(self.logprob_indices)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs; the same for every endpoint


@dataclass
class ForwardOutput:
    """What one forward returns. Logprobs are the model's log-softmax of the raw logits in float32, before any
    sampling transform (penalties, temperature, top-k/p, min-p, grammar masks): the same numbers on every
    backend. Top lists are sorted by logprob, descending."""

    next_token_ids: np.ndarray  # int64 [S]
    logprobs: np.ndarray | None = None  # float32 [S]: the sampled token's logprob (when batch.sample_logprobs)
    top_ids: np.ndarray | None = None  # int64 [S, K]
    top_logprobs: np.ndarray | None = None  # float32 [S, K]
    prompt_logprobs: np.ndarray | None = None  # float32 [P]: logprob of logprob_targets at logprob_indices
    prompt_top_ids: np.ndarray | None = None  # int64 [P, K]
    prompt_top_logprobs: np.ndarray | None = None  # float32 [P, K]


class KVPoolGeometry:
    """The shape both device KV pools share: ``num_pages`` pages of ``page_size`` tokens, every layer, K and V."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype_bytes: int) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype_bytes = dtype_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V: what one host page and one L3 file hold."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def check_host(self, host: "HostKVPool") -> None:
        if host.page_bytes != self.page_bytes or host.num_layers != self.num_layers:
            raise ValueError(
                f"host pool pages hold {host.page_bytes} bytes over {host.num_layers} layers but this device "
                f"pool's pages hold {self.page_bytes} bytes over {self.num_layers} layers; size the HostKVPool "
                "with page_bytes from the backend's pool (same page_size and dtype)"
            )


@dataclass
class HostKVPool:
    """Host-memory (L2) KV pages, backend-neutral: one raw byte array the runtime can hash, write and read.

    layout "page_first" (and "page_first_direct"): ``data[page]`` is one page, all layers, K then V, so a page
    is one contiguous block for file I/O. layout "layer_first": ``data[layer, page]``; a page is gathered from
    ``num_layers`` blocks when it is written to storage.
    """

    num_pages: int
    page_bytes: int  # bytes of one page, all layers, K and V
    num_layers: int
    layout: str
    # None (the default) = allocate here: __post_init__ always sets both, so a built pool has an array and an event;
    # mypy cannot express "optional in __init__ only" for a dataclass field
    data: np.ndarray = field(repr=False, default=None)  # type: ignore[arg-type]  # uint8
    prefault: bool = True  # fault the memory in on a background thread (backends/host_memory.py)
    faulted_in: threading.Event = field(repr=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.data is None:
            flat, self.faulted_in = allocate_host_bytes(self.num_pages * self.page_bytes, self.prefault)
            if self.layout == "layer_first":
                self.data = flat.reshape(self.num_layers, self.num_pages, self.page_bytes // self.num_layers)
            else:
                self.data = flat.reshape(self.num_pages, self.page_bytes)
        elif self.faulted_in is None:
            self.faulted_in = threading.Event()
            self.faulted_in.set()

    @property
    def total_bytes(self) -> int:
        return int(self.data.nbytes)

    def page_to_bytes(self, page: int) -> bytes:
        """One page as a contiguous byte string in page_first order (what L3 files store)."""
        row: np.ndarray = self.data[:, page] if self.layout == "layer_first" else self.data[page]
        return row.tobytes()

    def page_from_bytes(self, page: int, payload: bytes | memoryview) -> None:
        arr = np.frombuffer(payload, dtype=np.uint8)
        if arr.size != self.page_bytes:
            raise ValueError(f"page payload has {arr.size} bytes, expected {self.page_bytes}")
        if self.layout == "layer_first":
            self.data[:, page] = arr.reshape(self.num_layers, -1)
        else:
            self.data[page] = arr


# One host (L2) / storage (L3) state snapshot, per linear layer in HybridLayout.linear_layers order: the conv's last
# K-1 inputs channels-last [K-1, conv_dim] in the conv dtype, then the recurrent state in float32 in transformers'
# orientation (gated DeltaNet [Hv, Dk, Dv], Mamba2 [H, head_dim, d_state]), little-endian. Both backends write these
# bytes, so a torch snapshot serves MLX and back, as SHARED_PAGE_LAYOUT does for pages.
SHARED_STATE_LAYOUT = "layer,conv[k-1,c],rec[h,dk,dv]"


def host_state_layer_bytes(g: StateGeometry) -> tuple[int, int]:
    """(conv bytes, recurrent bytes) of one linear layer in a host state slot (SHARED_STATE_LAYOUT)."""
    rec = 1
    for d in g.rec_shape:
        rec *= d
    return (g.conv_kernel - 1) * g.conv_dim * DTYPE_BYTES[g.conv_dtype], rec * DTYPE_BYTES[g.rec_dtype]


@dataclass
class HostStatePool:
    """Host-memory (L2) state snapshots of a hybrid model, backend-neutral: ``data[slot]`` is one snapshot of every
    linear layer in SHARED_STATE_LAYOUT, one contiguous block (what an L3 state file stores)."""

    num_slots: int
    geometry: StateGeometry
    # None (the default) = allocate here (__post_init__ always sets it; see HostKVPool.data)
    data: np.ndarray = field(repr=False, default=None)  # type: ignore[arg-type]  # uint8 [num_slots, slot_bytes]
    # set once ``data``'s pages are faulted in (a background thread): the server waits for it before it reports
    # ready, so the RAM this pool was promised is committed before another instance sizes itself (issue 33)
    faulted_in: threading.Event = field(repr=False, default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.data is None:
            flat, self.faulted_in = allocate_host_bytes(self.num_slots * self.slot_bytes)
            self.data = flat.reshape(self.num_slots, self.slot_bytes)
        else:
            self.faulted_in.set()  # given memory: its owner committed it

    @property
    def slot_bytes(self) -> int:
        conv, rec = host_state_layer_bytes(self.geometry)
        return self.geometry.num_linear_layers * (conv + rec)

    @property
    def total_bytes(self) -> int:
        return int(self.data.nbytes)

    def layer_views(self, slot: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw bytes (conv, rec) of ``layer`` in host slot ``slot``, writable views into ``data``."""
        conv, rec = host_state_layer_bytes(self.geometry)
        base = layer * (conv + rec)
        row = self.data[slot]
        return row[base:base + conv], row[base + conv:base + conv + rec]


# Post-RoPE K and V (rotate-half convention) as [layer, K/V, token, head, dim], little-endian in the KV storage
# dtype (ModelInfo.kv_dtype; fp8_e4m3 is OCP E4M3FN, saturated to +-448, per-tensor scale 1.0: torch's
# float8_e4m3fn bits, which mx.to_fp8 writes too): what the torch and MLX pools store, so an L3 folder written by
# one backend serves the other (tests check it).
SHARED_PAGE_LAYOUT = "layer,kv,token,head,dim"


class KVCacheDtypeError(ValueError):
    """A --kv-cache-dtype the chosen backend cannot store; the message says which to use instead."""


class StatePoolOps(Protocol):
    """A hybrid's recurrent-state pool as ModelBackend drives it (backends/*/linear_state.py LinearState)."""

    def init_pool(self, num_slots: int) -> None: ...

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None: ...

    def to_host(self, slots: np.ndarray, host: HostStatePool, host_slots: np.ndarray) -> None: ...

    def from_host(self, host: HostStatePool, host_slots: np.ndarray, slots: np.ndarray) -> None: ...


class ModelBackend(ABC):
    """A backend executes the model and owns every tensor: weights, the device KV pool, sampling math."""

    name: str = "abstract"  # "torch" | "mlx"
    page_layout: str | None = None  # SHARED_PAGE_LAYOUT when its pages hold those bytes
    device: str = "cpu"
    info: ModelInfo
    # A hybrid's recurrent-state pool and its copies; None for attention-only models and on a backend without one.
    linear_state: StatePoolOps | None = None

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers in the device pool (in the KV storage dtype)."""
        i = self.info
        return kv_bytes_per_token(i.num_layers, i.num_kv_heads, i.head_dim, i.kv_dtype)

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of the loaded weights (sizing and logs)."""

    def weight_bytes_per_token(self) -> int | None:
        """Bytes of the loaded weights one decode step of one stream reads (the bandwidth bound of ``tierlm bench
        peers``), where the backend knows them; None where not (the bench then counts the checkpoint's)."""
        return None

    @abstractmethod
    def init_kv_pool(self, num_pages: int, page_size: int) -> None:
        """Allocate the device KV pool: ``num_pages`` pages of ``page_size`` tokens, every layer."""

    def init_decode_graphs(self, max_bs: int, context_length: int, capture: bool) -> dict[str, Any] | None:
        """Run decode-only steps of up to ``max_bs`` requests on static buffers padded to batch-size buckets, and
        with ``capture`` record them as graphs (CUDA). None when this backend has no such path (then every step
        runs as it comes); otherwise what it set up (buckets, captured sizes), for /server_info."""
        return None

    def init_torch_compile(self, max_bs: int) -> dict[str, Any]:
        """--enable-torch-compile: compile the model for decode-only steps of up to ``max_bs`` requests now (a few
        decode steps on pages no request owns), and run those steps through it from then on. ValueError with the
        reason where this backend or model cannot; what the compiler raises where compiling fails."""
        raise ValueError(f"--enable-torch-compile: torch.compile applies to the torch backend, not {self.name}; "
                         "drop the flag")

    def torch_compile_stats(self) -> dict[str, Any] | None:
        """The compiled decode path's live numbers (steps run compiled, compile seconds); None without one."""
        return None

    def set_host_io_backend(self, mode: str) -> None:
        """--hicache-io-backend (kernel | direct): how pages move to and from the host pool. Backends whose device
        pool is host memory (MLX) have one way only."""

    def decode_graph_stats(self) -> dict[str, Any] | None:
        """The static decode path's state now (steps it ran, captured sizes); None without one."""
        return None

    def kernels(self) -> dict[str, str]:
        """Which kernel each layer type runs (linear, prefill and decode attention), with why, as set up: for
        /server_info. Empty where the backend has one fixed set (its docs name them)."""
        return {}

    def init_state_pool(self, num_slots: int) -> None:
        """Allocate ``num_slots`` recurrent-state slots (ModelInfo.state); nothing to do for attention-only models."""
        if self.linear_state is not None:
            self.linear_state.init_pool(num_slots)
        elif self.info.state is not None:
            raise NotImplementedError(f"the {self.name} backend has no state pool for hybrid models")

    def copy_state_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy state slot ``src[i]`` to ``dst[i]`` (int32 arrays; a snapshot into a request's live slot), ordered
        before the next forward."""
        self._state_pool("has no state pool to copy within").copy_slots(src, dst)

    def copy_states_to_host(self, slots: np.ndarray, host: HostStatePool, host_slots: np.ndarray) -> None:
        """Copy state slot ``slots[i]`` into host slot ``host_slots[i]`` (SHARED_STATE_LAYOUT), done on return (an
        L3 writer may read it next)."""
        self._state_pool("has no host tier for state snapshots").to_host(slots, host, host_slots)

    def copy_states_from_host(self, host: HostStatePool, host_slots: np.ndarray, slots: np.ndarray) -> None:
        """Copy host slot ``host_slots[i]`` into state slot ``slots[i]``, ordered before the next forward."""
        self._state_pool("has no host tier for state snapshots").from_host(host, host_slots, slots)

    def _state_pool(self, missing: str) -> StatePoolOps:
        if self.linear_state is None:
            raise NotImplementedError(f"the {self.name} backend {missing}")
        return self.linear_state

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one batched forward over ``batch``: the sampled token ids, int64 [S], and the logprobs it asks
        for (``ForwardBatch.sample_logprobs``, ``logprob_indices``)."""

    # --- tier copies (HiCache). Pages are whole pages, all layers, K and V. ---
    @abstractmethod
    def copy_pages_to_host(self, device_pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
        """Copy device pages into host pages (same order)."""

    @abstractmethod
    def copy_pages_from_host(self, host: HostKVPool, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """Copy host pages into device pages (same order)."""

    def kv_namespace(self) -> dict[str, Any]:
        """Everything that decides what the bytes of a KV page mean; L3 keys are namespaced by it."""
        i = self.info
        ns = {
            "backend_layout": self.kv_byte_layout(),
            "dtype": i.dtype,
            "num_layers": i.num_layers,
            "num_kv_heads": i.num_kv_heads,
            "head_dim": i.head_dim,
            "model": i.fingerprint,
        }
        # Pages stored in another dtype than the model computes in (--kv-cache-dtype bf16|fp8_*) are other bytes;
        # pages in the model's own dtype keep the namespace they always had.
        if i.kv_dtype != i.dtype:
            ns["kv_dtype"] = i.kv_dtype
        # Quantized weights compute other K/V values; unquantized models keep the namespace they always had.
        if i.weight_format != "none":
            ns["weight_format"] = i.weight_format
        return ns

    def kv_byte_layout(self) -> str:
        """Names the byte order of a page; only equal strings share L3 pages. A backend shares the torch/MLX
        pages by setting ``page_layout = SHARED_PAGE_LAYOUT``; any other keeps a name of its own."""
        return self.page_layout or f"{self.name}:private"


# ---------------------------------------------------------------- structured output (grammar-constrained decoding)
class GrammarCompileError(ValueError):
    """A grammar (JSON schema, regex, EBNF) the compiler refuses; the message is the compiler's."""


class GrammarCompileTimeout(GrammarCompileError):
    """A compile ran past its time limit and was stopped (nothing of it keeps running)."""


class GrammarCompilerUnavailable(GrammarCompileError):
    """The compiler itself could not run (its worker process did not start): the server's fault, not the
    grammar's, so the failure is not remembered against the grammar."""


class GrammarMatcher(ABC):
    """One request's position in its grammar: which tokens may come next, and the tokens it accepted."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, packed as SamplingBatch.token_bitmask)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it (the caller ends the request)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary (thread-safe: compiles run on a pool) and makes
    per-request matchers. ``kind`` is "json_schema" | "regex" | "ebnf"."""

    name: str = "abstract"
    vocab_size: int  # columns of the logits the bitmask covers

    @abstractmethod
    def compile(self, kind: str, text: str, timeout_s: float | None = None) -> Any:
        """A compiled grammar, or GrammarCompileError with the compiler's message; GrammarCompileTimeout when the
        compile itself (not any wait for a free compiler before it) runs longer than ``timeout_s``."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def compiled_bytes(self, compiled: Any) -> int:
        """Memory a compiled grammar holds (the grammar cache is bounded by it); 0 where unknown."""
        return 0

    def close(self) -> None:
        """Stop whatever the compiler runs in the background (its worker processes)."""

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An all-allowed bitmask for ``rows`` rows."""
        return np.full((rows, (self.vocab_size + 31) // 32), -1, np.int32)
