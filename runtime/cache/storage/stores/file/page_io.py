"""The file store's system calls on page files: one preadv of a whole page into the caller's buffers, the mtime
touch that orders the LRU index, a quiet unlink."""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_HAVE_PREADV = hasattr(os, "preadv")
_IOV_MAX = 1024  # POSIX minimum is 16, Linux and macOS allow 1024; a page is 1 + (1 or num_layers) buffers


def read_fully(fd: int, views: list[memoryview]) -> int:
    """Fill ``views`` in order from offset 0 of ``fd`` (one preadv where the OS has it); returns the bytes read,
    fewer than asked only at end of file."""
    views = list(views)
    total = i = 0
    while i < len(views):
        if _HAVE_PREADV:
            n = os.preadv(fd, views[i:i + _IOV_MAX], total)
        else:  # Windows: no preadv
            os.lseek(fd, total, os.SEEK_SET)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                n = f.readinto(views[i]) or 0
        if n <= 0:
            break
        total += n
        while n and i < len(views):
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


def touch_fd(fd: int) -> None:
    # The mtime orders the LRU index rebuilt after a restart; failure only costs that order.
    try:
        os.utime(fd)
    except OSError:
        pass


def unlink_quietly(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        logger.warning("could not remove %s: %s", path, e)
        return False
