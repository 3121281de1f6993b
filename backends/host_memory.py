"""Host (L2) memory for KV pages: one anonymous mapping, faulted in by a background thread after startup.

A fresh mapping costs a page fault per 4 KiB on first touch; in a VM whose guest memory is backed lazily that is
~100 ms per 48 MiB, paid inside the first L3 read or L2 demotion that lands there (issue 20: it made a first L3 hit
after a restart 1.45x an L2 hit). MADV_POPULATE_WRITE (Linux 5.14+) faults the pages in without changing their
contents, so it is safe while the pool is already in use. It commits the host tier's RAM at startup, which the
memory plan already reserved for it (as SGLang's pinned host pool does).
"""
from __future__ import annotations

import logging
import mmap
import sys
import threading
import time

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux value; Python 3.11 lacks the constant
PREFAULT_CHUNK = 8 << 20  # one madvise call holds the GIL for a few ms at most


def allocate_host_bytes(nbytes: int, prefault: bool = True) -> tuple[np.ndarray, threading.Event]:
    """``nbytes`` zeroed bytes as a flat uint8 array, and an event set once they are faulted in (at once where
    the platform cannot populate, e.g. macOS: pages then fault in on first use, as before)."""
    done = threading.Event()
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        done.set()
        return np.zeros(max(nbytes, 0), np.uint8), done
    buf = mmap.mmap(-1, nbytes)  # anonymous: zero-filled, like np.zeros
    data = np.frombuffer(buf, np.uint8)
    if prefault:
        threading.Thread(target=_populate, args=(buf, nbytes, done), name="tierlm-host-prefault",
                         daemon=True).start()
    else:
        done.set()
    return data, done


def _populate(buf: mmap.mmap, nbytes: int, done: threading.Event) -> None:
    start = time.perf_counter()
    try:
        for off in range(0, nbytes, PREFAULT_CHUNK):
            buf.madvise(MADV_POPULATE_WRITE, off, min(PREFAULT_CHUNK, nbytes - off))
            time.sleep(0)  # let the scheduler and HTTP threads run between chunks
    except (OSError, ValueError) as e:  # kernel older than 5.14: pages fault in on first use instead
        log.info("host KV pool: not pre-faulted (%s); its pages are faulted in on first use", e)
    else:
        log.info("host KV pool: %.0f MiB faulted in in %.2f s (so the first L2/L3 hit does not pay for it)",
                 nbytes / 2**20, time.perf_counter() - start)
    finally:
        done.set()
