"""Fault injection for L3 file writes: a full disk (ENOSPC) or a read-only one (EROFS). Tests run as root, where
chmod does not stop writes, so the fault is injected into the file store's open() instead (stores/file/storage.py)."""
from __future__ import annotations

import builtins
import errno
import os

from tierlm.runtime.cache.storage.stores.file import storage as fs_mod


class _FaultyFile:
    """A file object whose writes fail with ``err``, after the file itself was created."""

    def __init__(self, f, err: int) -> None:
        self._f, self._err = f, err

    def write(self, data):
        raise OSError(self._err, os.strerror(self._err))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def inject_disk_fault(monkeypatch, err: int) -> None:
    """Make the file store's page writes fail like a full (ENOSPC) or read-only (EROFS) disk (root ignores chmod)."""
    def faulty_open(path, mode="r", *args, **kw):
        if "x" not in mode:
            return builtins.open(path, mode, *args, **kw)
        if err == errno.EROFS:
            raise OSError(err, os.strerror(err), str(path))
        return _FaultyFile(builtins.open(path, mode, *args, **kw), err)

    monkeypatch.setattr(fs_mod, "open", faulty_open, raising=False)
