"""The MLX device KV pool: fixed-size pages of K and V for every layer, one flat slot axis per layer.

Slot ``page * page_size + offset`` holds one token's K (and V) for all KV heads, after RoPE. Each layer keeps
its own K and V array [slots, kv_heads, head_dim] so a step's write is one scatter per layer and array. A page
moves to and from the host tier as raw bytes in the order [layer, K/V, token, head, dim] (the torch pool's).

KV storage dtype: the model's dtype, bfloat16, or fp8 e4m3 (``fp8=True``): uint8 arrays written by ``mx.to_fp8``
(saturating at +-448, round to nearest even: the same bits as torch's float8_e4m3fn cast of the clamped value,
so pages stay interchangeable with the torch pool's) and read back by ``mx.from_fp8``. MLX has no e5m2 cast.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from tierlm.backends.base import HostKVPool, KVPoolGeometry

# numpy has no bfloat16: its raw 2-byte values travel as uint16, which has the same size and byte order.
_RAW_VIEW = {mx.float32: mx.float32, mx.float16: mx.float16, mx.bfloat16: mx.uint16, mx.uint8: mx.uint8}


class MLXKVPool(KVPoolGeometry):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: mx.Dtype, fp8: bool = False) -> None:
        """``dtype``: the KV storage dtype (float32, float16, bfloat16); ``fp8``: store fp8 e4m3 bits instead."""
        if fp8:
            dtype = mx.uint8
        elif dtype not in _RAW_VIEW or dtype == mx.uint8:
            raise ValueError(f"KV pool dtype {dtype} is not supported; use float32, float16 or bfloat16")
        super().__init__(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype.size)
        self.fp8 = fp8
        self.dtype = dtype  # the arrays' element type (uint8 for fp8)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def arrays(self) -> list[mx.array]:
        return self.k + self.v

    def quantize(self, x: mx.array) -> mx.array:
        """K or V values -> the arrays' element type (fp8: e4m3 bits as uint8)."""
        return mx.to_fp8(x) if self.fp8 else x.astype(self.dtype)

    def dequantize(self, stored: mx.array, dtype: mx.Dtype) -> mx.array:
        return mx.from_fp8(stored, dtype=dtype) if self.fp8 else stored.astype(dtype)

    def as_stored(self, x: mx.array) -> mx.array:
        """``x`` as a later read of the pool returns it (what attention over fresh K/V must see, so a cache hit
        gives the same numbers); ``x`` itself when the pool stores its dtype."""
        if not self.fp8 and x.dtype == self.dtype:
            return x
        return self.dequantize(self.quantize(x), x.dtype)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Store the K/V of new tokens [n, kv_heads, head_dim] at ``slots`` [n] (lazy; eval with the step)."""
        self._store(layer, slots, self.quantize(k), self.quantize(v))

    def _store(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def _page_slots(self, pages: np.ndarray) -> mx.array:
        pages = np.asarray(pages, np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise IndexError(f"device pages {pages.tolist()} outside the pool of {self.num_pages} pages")
        return mx.array((pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1).astype(np.int32))

    def gather_pages(self, pages: np.ndarray) -> mx.array:
        """Pages as [n, layer, K/V, token, head, dim]."""
        slots = self._page_slots(pages)
        n = len(np.asarray(pages).reshape(-1))
        per_layer = [mx.stack([self.k[l][slots], self.v[l][slots]]) for l in range(self.num_layers)]
        blocks = mx.stack(per_layer)  # [layer, K/V, n*page_size, head, dim]
        blocks = blocks.reshape(self.num_layers, 2, n, self.page_size, self.num_kv_heads, self.head_dim)
        return blocks.transpose(2, 0, 1, 3, 4, 5)

    def scatter_pages(self, pages: np.ndarray, blocks: mx.array) -> None:
        """Write [n, layer, K/V, token, head, dim] into ``pages``."""
        slots = self._page_slots(pages)
        n = blocks.shape[0]
        for l in range(self.num_layers):
            kv = blocks[:, l].transpose(1, 0, 2, 3, 4).reshape(2, n * self.page_size, self.num_kv_heads,
                                                                 self.head_dim)
            self._store(l, slots, kv[0], kv[1])  # already the stored elements
        mx.eval(self.k, self.v)

    def to_host(self, pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
        self.check_host(host)
        pages, host_pages = np.asarray(pages).reshape(-1), np.asarray(host_pages).reshape(-1)
        if len(pages) == 0:
            return
        blocks = self.gather_pages(pages).view(_RAW_VIEW[self.dtype])
        raw = np.ascontiguousarray(np.array(blocks)).view(np.uint8).reshape(len(pages), self.num_layers, -1)
        if host.layout == "layer_first":
            host.data[:, host_pages] = raw.transpose(1, 0, 2)
        else:
            host.data[host_pages] = raw.reshape(len(pages), -1)

    def from_host(self, host: HostKVPool, host_pages: np.ndarray, pages: np.ndarray) -> None:
        self.check_host(host)
        pages, host_pages = np.asarray(pages).reshape(-1), np.asarray(host_pages).reshape(-1)
        if len(pages) == 0:
            return
        if host.layout == "layer_first":
            raw = host.data[:, host_pages].transpose(1, 0, 2)
        else:
            raw = host.data[host_pages]
        raw = np.ascontiguousarray(raw).reshape(-1)
        values = mx.array(raw.view(np.dtype(_numpy_name(self.dtype)))).view(self.dtype)
        blocks = values.reshape(len(pages), self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        self.scatter_pages(pages, blocks)


def _numpy_name(dtype: mx.Dtype) -> str:
    return {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "uint16", mx.uint8: "uint8"}[dtype]
