"""The device KV pool: fixed-size pages of K and V for every layer, one flat slot axis per layer.

Slot ``page * page_size + offset`` holds one token's K (and V) for all KV heads. Page contents move to and
from the host tier (HostKVPool) as whole pages, all layers, K then V.
"""
from __future__ import annotations

import numpy as np
import torch

from tierlm.backends.base import HostKVPool, KVPoolGeometry


class TorchKVPool(KVPoolGeometry):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype.itemsize)
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
        self._stage: torch.Tensor | None = None

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
        self.check_host(host)
        n, L = len(pages), self.num_layers
        shape = (self.page_size, self.num_kv_heads, self.head_dim)
        stage = self._staging(n)
        raw = stage.numpy()
        host_pages = np.asarray(host_pages, dtype=np.int64)
        # mode="clip" makes np.take write straight into ``out`` (mode="raise" buffers a temporary copy).
        if host.layout == "layer_first":
            np.take(host.data.reshape(L, host.num_pages, 2, -1), host_pages, axis=1, mode="clip",
                    out=raw.reshape(L, n, 2, -1))
            blocks = stage.view(self.dtype).view(L, n, 2, *shape).permute(0, 2, 1, 3, 4, 5)
        else:
            np.take(host.data.reshape(host.num_pages, L, 2, -1), host_pages, axis=0, mode="clip",
                    out=raw.reshape(n, L, 2, -1))
            blocks = stage.view(self.dtype).view(n, L, 2, *shape).permute(1, 2, 0, 3, 4, 5)
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device)
        self._page_view().index_copy_(2, idx, blocks.to(self.device))
