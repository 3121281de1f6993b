"""The device KV pool: fixed-size pages of K and V for every layer, one flat slot axis per layer.

Slot ``page * page_size + offset`` holds one token's K (and V) for all KV heads. Page contents move to and
from the host tier (HostKVPool) as whole pages, all layers, K then V.

KV storage dtype (``--kv-cache-dtype``): the model's dtype, bfloat16, or an 8-bit float (per-tensor scale 1.0,
as SGLang without checkpoint scales). fp8 pages are held as uint8 (CPU torch has no ``index_copy_`` for float8):
``quantize`` saturates to the format's finite range (a cast beyond it is NaN in e4m3fn) and stores the bits,
``dequantize`` views them as float8 and upcasts. Host and file copies move those bytes unchanged.
"""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.base import HostKVPool, KVPoolGeometry
from tierlm.backends.torch.host_copies import (DIRECT, HostCopyEngine, cpu_from_host, cpu_to_host, direct_from_host,
                                                direct_to_host)

# dtypes.kv_storage_dtype names -> torch dtypes.
KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Largest finite value of each 8-bit format; values beyond it are stored saturated.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class TorchKVPool(KVPoolGeometry):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """``dtype``: the KV storage dtype (float32, bfloat16, float16, float8_e4m3fn or float8_e5m2)."""
        super().__init__(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype.itemsize)
        self.kv_dtype = dtype  # what the pages hold
        self.fp8_max = FP8_MAX.get(dtype)
        self.dtype = torch.uint8 if self.fp8_max is not None else dtype  # the buffer's element type
        self.device = device
        # [layer, K/V, slot, head, dim]: one allocation; per-layer views are what attention indexes.
        self.buffer = torch.zeros(
            (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim), dtype=self.dtype, device=device
        )
        self.k = [self.buffer[layer, 0] for layer in range(num_layers)]
        self.v = [self.buffer[layer, 1] for layer in range(num_layers)]
        # The same memory as [page, token-in-page, head, dim]: attention gathers whole pages.
        self.k_pages = [k.view(num_pages, page_size, num_kv_heads, head_dim) for k in self.k]
        self.v_pages = [v.view(num_pages, page_size, num_kv_heads, head_dim) for v in self.v]
        self._stage: torch.Tensor | None = None
        self._layer_ptrs: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._layer_table: torch.Tensor | None = None  # layer_pointers as a tensor, for the C++ attention op
        # On CPU the pool's own bytes [layer, K/V, page, block]: host copies move pages between them in one pass.
        self._cpu_bytes = self.buffer.view(torch.uint8).numpy().reshape(num_layers, 2, num_pages, -1) \
            if device.type == "cpu" else None
        self.copies = HostCopyEngine(device)  # --hicache-io-backend, the copy stream and pinning (host_copies.py)

    def set_io_backend(self, mode: str) -> None:
        """--hicache-io-backend: kernel (batched: on CPU one pass per run of pages, on CUDA a gather + one DMA) or
        direct (one copy per page and layer)."""
        self.copies = HostCopyEngine(self.device, mode)

    # --- what attention writes and reads ---
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """K or V values -> the buffer's element type (fp8: saturated, rounded to nearest even, as uint8 bits)."""
        if self.fp8_max is None:
            return x.to(self.dtype)
        return x.clamp(-self.fp8_max, self.fp8_max).to(self.kv_dtype).view(torch.uint8)

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored elements (as ``quantize`` returns them, or gathered from the buffer) -> ``dtype``."""
        if self.fp8_max is not None:
            stored = stored.view(self.kv_dtype)
        return stored.to(dtype)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a later read of the pool returns it: what attention over fresh K/V must see so a cache hit
        (the same K/V read back from any tier) gives the same numbers. ``x`` itself when the pool is exact."""
        if self.kv_dtype == x.dtype:
            return x
        return self.dequantize(self.quantize(x), x.dtype)

    def layer_pointers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each layer's K and V slot rows [slots, kv_heads, head_dim] as addresses, for C kernels that write and read
        the pool in place (cpu/decode_step.py); the buffer is never reallocated, so they are taken once."""
        if self._layer_ptrs is None:
            self._layer_ptrs = (tuple(k.data_ptr() for k in self.k), tuple(v.data_ptr() for v in self.v))
        return self._layer_ptrs

    def layer_pointer_table(self) -> torch.Tensor:
        """``layer_pointers`` as an int64 tensor [2, layers] (K, V) a C++ op reads (cpu/step_record.py), made once."""
        if self._layer_table is None:
            self._layer_table = torch.tensor(self.layer_pointers(), dtype=torch.int64)
        return self._layer_table

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V [n, kv_heads, head_dim] at flat ``slots`` [n] of ``layer``."""
        self.k[layer].index_copy_(0, slots, self.quantize(k))
        self.v[layer].index_copy_(0, slots, self.quantize(v))

    def _page_view(self) -> torch.Tensor:
        # [layer, K/V, page, token, head, dim]
        return self.buffer.view(self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def _staging(self, n: int) -> torch.Tensor:
        """Host bytes for ``n`` pages, reused across copies (grown, never shrunk).

        A fresh buffer of tens of MiB page-faults on first touch on every copy (~100 ms per 48 MiB measured in
        a VM), which is more than the copy itself; a persistent one is faulted in once. Pinned for CUDA.
        """
        need = n * self.page_bytes
        if self._stage is None or self._stage.numel() < need:
            old = 0 if self._stage is None else self._stage.numel()
            self._stage = torch.empty(max(need, 2 * old), dtype=torch.uint8,
                                      pin_memory=self.device.type == "cuda")
        return self._stage[:need]

    def to_host(self, pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
        self.check_host(host)
        c = self.copies
        c.pin(host.data)
        c.before_staging_reuse()
        if self._cpu_bytes is not None and c.mode != DIRECT:
            cpu_to_host(self._cpu_bytes, np.asarray(pages), host, np.asarray(host_pages))
            return
        if c.mode == DIRECT:
            with c.begin_load():  # the copy stream, after the compute that wrote these pages
                direct_to_host(self._page_view(), np.asarray(pages), host, np.asarray(host_pages), c.cuda)
            if c.cuda:
                c.stream.synchronize()  # an L3 writer may read the host page as soon as this returns
            return
        n, L = len(pages), self.num_layers
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device)
        stage = self._staging(n)
        blocks = stage.view(self.dtype).view(L, 2, n, self.page_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            torch.index_select(self._page_view(), 2, idx, out=blocks)
        else:
            blocks.copy_(self._page_view().index_select(2, idx))
        raw = stage.numpy().reshape(L, 2, n, -1)  # bytes of [layer, K/V, page, token*head*dim]
        if host.layout == "layer_first":
            host.data.reshape(L, host.num_pages, 2, -1)[:, host_pages] = raw.transpose(0, 2, 1, 3)
        else:
            host.data.reshape(host.num_pages, L, 2, -1)[host_pages] = raw.transpose(2, 0, 1, 3)

    def from_host(self, host: HostKVPool, host_pages: np.ndarray, pages: np.ndarray) -> None:
        """Pages back into the device pool; on CUDA asynchronously on the copy stream, ordered before the next
        forward by an event (host_copies.py)."""
        self.check_host(host)
        c = self.copies
        c.pin(host.data)
        c.before_staging_reuse()
        if self._cpu_bytes is not None and c.mode != DIRECT:
            cpu_from_host(self._cpu_bytes, host, np.asarray(host_pages), np.asarray(pages))
            return
        if c.mode == DIRECT:
            with c.begin_load():
                direct_from_host(self._page_view(), host, np.asarray(host_pages), np.asarray(pages), c.cuda)
            c.end_load()
            return
        n, L = len(pages), self.num_layers
        shape = (self.page_size, self.num_kv_heads, self.head_dim)
        stage = self._staging(n)
        raw = stage.numpy()
        host_pages = np.asarray(host_pages, dtype=np.int64)
        # mode="clip" makes np.take write straight into ``out`` (mode="raise" buffers a temporary copy).
        if host.layout == "layer_first":
            np.take(host.data.reshape(L, host.num_pages, 2, -1), host_pages, axis=1, mode="clip",
                    out=raw.reshape(L, n, 2, -1))
        else:
            np.take(host.data.reshape(host.num_pages, L, 2, -1), host_pages, axis=0, mode="clip",
                    out=raw.reshape(n, L, 2, -1))
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device)
        with c.begin_load():
            # One contiguous copy of the staging bytes (a DMA from pinned memory on CUDA), then the scatter.
            dev = stage.to(self.device, non_blocking=c.cuda).view(self.dtype)
            if host.layout == "layer_first":
                blocks = dev.view(L, n, 2, *shape).permute(0, 2, 1, 3, 4, 5)
            else:
                blocks = dev.view(n, L, 2, *shape).permute(1, 2, 0, 3, 4, 5)
            self._page_view().index_copy_(2, idx, blocks)
        c.end_load()
