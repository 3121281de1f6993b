"""The file store's folder and size bound, from the environment and --hicache-storage-backend-extra-config
(``max_size_gb``, ``io_timeout``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Mapping

from tierlm.runtime.cache.storage.storage_io import DEFAULT_IO_TIMEOUT_S

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
KNOWN_EXTRA_CONFIG_KEYS = ("max_size_gb", "io_timeout")
IO_TIMEOUT_KEY = "io_timeout"  # the tier's I/O time limit (storage_io.py), also the limit of opening the folder
# Default L3 bound without max_size_gb: what this namespace already stores plus a quarter of the free space of
# the folder's filesystem at startup, at most 100 GB. Keeping what is stored means a restart evicts nothing;
# a quarter of the free space leaves the rest to the machine (and to other servers sharing the disk, each of
# which takes a quarter of what is left); the cap stops a huge shared filesystem from becoming one cache.
AUTO_BOUND: Literal["auto"] = "auto"
DEFAULT_BOUND_FREE_SHARE = 0.25
DEFAULT_BOUND_MAX_BYTES = 100 * 10**9


def default_max_size_bytes(free_bytes: int, stored_bytes: int, min_bytes: int = 1) -> int:
    """The bound used when extra-config has no max_size_gb (see DEFAULT_BOUND_* for the rule)."""
    share = stored_bytes + int(free_bytes * DEFAULT_BOUND_FREE_SHARE)
    return max(min_bytes, min(DEFAULT_BOUND_MAX_BYTES, share))


def default_storage_dir() -> Path:
    """$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else <user cache dir>/tierlm/hicache (not /tmp: it must survive)."""
    env = os.environ.get(STORAGE_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("tierlm")) / "hicache"


def max_size_bytes_from_config(cfg: Mapping[str, object]) -> int | None:
    """The bound from extra-config ``max_size_gb`` (GB = 1e9 bytes, as SGLang's --hicache-size); None = unbounded."""
    gb = cfg.get("max_size_gb")
    if gb is None:
        return None
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0:
        raise ValueError(f"extra-config max_size_gb must be a positive number of GB, got {gb!r}")
    return int(gb * 1e9)




def io_timeout_from_config(cfg: Mapping[str, object]) -> float:
    """The tier's I/O time limit in seconds, from extra-config ``io_timeout`` (default DEFAULT_IO_TIMEOUT_S)."""
    timeout = cfg.get(IO_TIMEOUT_KEY, DEFAULT_IO_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"extra-config io_timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)
