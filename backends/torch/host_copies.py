"""Page copies between the device KV pool and the host (L2) pool on CUDA: pinned memory, a copy stream, events.

``--hicache-io-backend`` (SGLang's flag):
  kernel  one batched device gather into a contiguous staging block, one DMA, then the pages are placed (the
          default; a few large copies);
  direct  one asynchronous copy per page and layer straight between the pools, no staging (many small copies;
          what SGLang's ``direct`` does without its kernels).

On CUDA the host pool's memory is registered as page-locked once (``cudaHostRegister``), so copies to and from it
are real DMAs that overlap compute. Loads into the device run on a dedicated copy stream and end with an event;
the next forward's stream waits on that event (a device-side wait: the scheduler thread never blocks on it).
Saves to the host (demotions) are waited for before they return, because an L3 writer may read the host page
right after. On CPU both modes are plain memory copies and every call is synchronous: there the device pool is
host memory too, so pages move in one pass between the two pools' bytes (``cpu_to_host`` / ``cpu_from_host``), one
numpy copy per run of consecutive pages (no staging block, no per-layer loop, no thread pool to wake).
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import numpy as np
import torch

from tierlm.backends.base import HostKVPool

log = logging.getLogger(__name__)

KERNEL, DIRECT = "kernel", "direct"
IO_BACKENDS = (KERNEL, DIRECT)


class HostCopyEngine:
    """The copy mode and, on CUDA, the copy stream, the pending-load event and the pinned registrations."""

    def __init__(self, device: torch.device, mode: str = KERNEL) -> None:
        if mode not in IO_BACKENDS:
            raise ValueError(f"--hicache-io-backend {mode!r}: use kernel or direct")
        self.device = device
        self.mode = mode
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._load_done: torch.cuda.Event | None = None  # the last load, waited on by the next forward
        self._registered: set[int] = set()  # data pointers of host arrays registered as page-locked

    # --- pinned host memory ---
    def pin(self, host_data: np.ndarray) -> None:
        """Register the host pool's memory as page-locked once (CUDA only), so copies to it are DMAs."""
        if not self.cuda:
            return
        ptr = host_data.__array_interface__["data"][0]
        if ptr in self._registered:
            return
        rc = torch.cuda.cudart().cudaHostRegister(ptr, host_data.nbytes, 0)
        if int(rc) != 0:  # already pinned elsewhere, or the platform refuses: copies still work, synchronously
            log.warning("host KV pool: cudaHostRegister of %.0f MiB returned %s; copies stay pageable",
                        host_data.nbytes / 2**20, rc)
        else:
            log.info("host KV pool: %.0f MiB registered as pinned memory (DMA copies on a copy stream)",
                     host_data.nbytes / 2**20)
        self._registered.add(ptr)

    # --- ordering ---
    def begin_load(self) -> AbstractContextManager:
        """The context a device load runs in: the copy stream on CUDA (after the compute stream's pending work,
        so pages being overwritten are no longer read), else nothing."""
        if not self.cuda:
            return _NullContext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def end_load(self) -> None:
        """Mark the load done for the next forward (an event on the copy stream)."""
        if self.cuda:
            self._load_done = torch.cuda.Event()
            self._load_done.record(self.stream)

    def before_forward(self) -> None:
        """The compute stream waits (on the device) for the last load; no host synchronization."""
        if self.cuda and self._load_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._load_done)
            self._load_done = None

    def before_staging_reuse(self) -> None:
        """A staging buffer is about to be overwritten on the host: the load that read it must be finished."""
        if self.cuda and self._load_done is not None:
            self._load_done.synchronize()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def host_page_tensors(host: HostKVPool, page: int, num_layers: int) -> list[torch.Tensor]:
    """Per-layer byte views of host page ``page`` as uint8 tensors [2, bytes per K or V] (torch.from_numpy: the
    same memory), in the order of the page's layers."""
    if host.layout == "layer_first":
        return [torch.from_numpy(host.data[layer, page]).view(2, -1) for layer in range(num_layers)]
    row = host.data[page].reshape(num_layers, 2, -1)
    return [torch.from_numpy(row[layer]) for layer in range(num_layers)]


def direct_to_host(page_view: torch.Tensor, pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray,
                   non_blocking: bool) -> None:
    """``page_view`` [layer, K/V, page, ...] of the device pool; each (page, layer) block copied on its own."""
    L = page_view.shape[0]
    raw = page_view.reshape(L, 2, page_view.shape[2], -1).view(torch.uint8) if page_view.dtype != torch.uint8 \
        else page_view.reshape(L, 2, page_view.shape[2], -1)
    for p, hp in zip(pages.tolist(), host_pages.tolist()):
        for layer, dst in enumerate(host_page_tensors(host, hp, L)):
            dst.copy_(raw[layer, :, p], non_blocking=non_blocking)


def direct_from_host(page_view: torch.Tensor, host: HostKVPool, host_pages: np.ndarray, pages: np.ndarray,
                     non_blocking: bool) -> None:
    L = page_view.shape[0]
    raw = page_view.reshape(L, 2, page_view.shape[2], -1).view(torch.uint8) if page_view.dtype != torch.uint8 \
        else page_view.reshape(L, 2, page_view.shape[2], -1)
    for p, hp in zip(pages.tolist(), host_pages.tolist()):
        for layer, src in enumerate(host_page_tensors(host, hp, L)):
            raw[layer, :, p].copy_(src, non_blocking=non_blocking)


def page_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, count) of each run where both page lists step by one together:
    allocators hand out consecutive pages, so a prefix is usually one run or a few."""
    src, dst = np.asarray(src, dtype=np.int64).reshape(-1), np.asarray(dst, dtype=np.int64).reshape(-1)
    if len(src) == 0:
        return []
    cuts = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(src)]))
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist())]


def _host_blocks(host: HostKVPool, num_layers: int) -> tuple[np.ndarray, bool]:
    """The host pool's bytes as [page, layer, K/V, block] (page_first) or [layer, page, K/V, block] (layer_first),
    and whether it is layer_first."""
    if host.layout == "layer_first":
        return host.data.reshape(num_layers, host.num_pages, 2, -1), True
    return host.data.reshape(host.num_pages, num_layers, 2, -1), False


def cpu_from_host(dev_bytes: np.ndarray, host: HostKVPool, host_pages: np.ndarray, pages: np.ndarray) -> None:
    """Host pages into the CPU device pool whose bytes are ``dev_bytes`` [layer, K/V, page, block]: one pass."""
    blocks, layer_first = _host_blocks(host, dev_bytes.shape[0])
    for h, d, k in page_runs(host_pages, pages):
        src = blocks[:, h:h + k].transpose(0, 2, 1, 3) if layer_first else blocks[h:h + k].transpose(1, 2, 0, 3)
        np.copyto(dev_bytes[:, :, d:d + k], src)


def cpu_to_host(dev_bytes: np.ndarray, pages: np.ndarray, host: HostKVPool, host_pages: np.ndarray) -> None:
    """CPU device pool pages into host pages, the reverse of cpu_from_host: one pass."""
    blocks, layer_first = _host_blocks(host, dev_bytes.shape[0])
    for d, h, k in page_runs(pages, host_pages):
        dst = blocks[:, h:h + k].transpose(0, 2, 1, 3) if layer_first else blocks[h:h + k].transpose(1, 2, 0, 3)
        np.copyto(dst, dev_bytes[:, :, d:d + k])
