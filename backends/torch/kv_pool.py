"""The device KV pool: fixed-size pages of K and V for every layer, one flat slot axis per layer.

Slot ``page * page_size + offset`` holds one token's K (and V) for all KV heads. Page contents move to and
from the host tier (HostKVPool) as whole pages, all layers, K then V.
"""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.base import HostKVPool


class TorchKVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # [layer, K/V, slot, head, dim]: one allocation; per-layer views are what attention indexes.
        self.buffer = torch.zeros(
            (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.k = [self.buffer[layer, 0] for layer in range(num_layers)]
        self.v = [self.buffer[layer, 1] for layer in range(num_layers)]
        # The same memory as [page, token-in-page, head, dim]: attention gathers whole pages.
        self.k_pages = [k.view(num_pages, page_size, num_kv_heads, head_dim) for k in self.k]
        self.v_pages = [v.view(num_pages, page_size, num_kv_heads, head_dim) for v in self.v]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.buffer.element_size()

    def _page_view(self) -> torch.Tensor:
        # [layer, K/V, page, token, head, dim]
        return self.buffer.view(self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def gather_pages(self, pages: np.ndarray) -> torch.Tensor:
        """Pages as [n, layer, K/V, token, head, dim] (page-first), on the pool's device."""
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device)
        return self._page_view().index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()

    def scatter_pages(self, pages: np.ndarray, data: torch.Tensor) -> None:
        """Write [n, layer, K/V, token, head, dim] into ``pages``."""
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device)
        self._page_view().index_copy_(2, idx, data.permute(1, 2, 0, 3, 4, 5).to(self.device, self.dtype))

    def to_host(self, pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
        blocks = self.gather_pages(pages).cpu()
        raw = _as_bytes(blocks).reshape(len(pages), self.num_layers, -1)  # [n, layer, layer_page_bytes]
        if host.layout == "layer_first":
            host.data[:, host_pages] = raw.transpose(1, 0, 2)
        else:
            host.data[host_pages] = raw.reshape(len(pages), -1)

    def from_host(self, host: HostKVPool, host_pages: np.ndarray, pages: np.ndarray) -> None:
        if host.layout == "layer_first":
            raw = host.data[:, host_pages].transpose(1, 0, 2)
        else:
            raw = host.data[host_pages]
        raw = np.ascontiguousarray(raw).reshape(-1)
        blocks = _from_bytes(raw, self.dtype).view(
            len(pages), self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        self.scatter_pages(pages, blocks)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's raw bytes as a uint8 numpy array (bfloat16 has no numpy dtype, so go through uint8)."""
    return t.contiguous().view(torch.uint8).numpy()


def _from_bytes(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(raw.copy()).view(dtype)
