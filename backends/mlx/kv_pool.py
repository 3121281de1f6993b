"""The MLX device KV pool: fixed-size pages of K and V for every layer, one flat slot axis per layer.

Slot ``page * page_size + offset`` holds one token's K (and V) for all KV heads, after RoPE. Each layer keeps
its own K and V array [slots, kv_heads, head_dim] so a step's write is one scatter per layer and array. A page
moves to and from the host tier as raw bytes in the order [layer, K/V, token, head, dim] (the torch pool's).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from tierlm.backends.base import HostKVPool, KVPoolGeometry

# numpy has no bfloat16: its raw 2-byte values travel as uint16, which has the same size and byte order.
_RAW_VIEW = {mx.float32: mx.float32, mx.float16: mx.float16, mx.bfloat16: mx.uint16}


class MLXKVPool(KVPoolGeometry):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: mx.Dtype) -> None:
        if dtype not in _RAW_VIEW:
            raise ValueError(f"KV pool dtype {dtype} is not supported; use float32, float16 or bfloat16")
        super().__init__(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype.size)
        self.dtype = dtype
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.k, self.v)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def arrays(self) -> list[mx.array]:
        return self.k + self.v

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Store the K/V of new tokens [n, kv_heads, head_dim] at ``slots`` [n] (lazy; eval with the step)."""
        self.k[layer][slots] = k.astype(self.dtype)
        self.v[layer][slots] = v.astype(self.dtype)

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
            self.write(l, slots, kv[0], kv[1])
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
    return {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "uint16"}[dtype]
