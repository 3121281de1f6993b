"""L3 on Mooncake Store: KV pages in a distributed in-memory store shared by several tierlm servers.

``--hicache-storage-backend mooncake`` (install: ``pip install 'tierlm[mooncake]'``). Objects are named
``tierlm_<namespace id>_<page key>``: the same SHA-256 page keys as the file tier, under the full namespace id
(model fingerprint, KV dtype, page size, layout, format version), so two servers of the same model share pages
and servers of different models never read each other's. Each value is the 128-byte page header of
page_header.py followed by the payload, verified on every read before it reaches the host pool: a short,
foreign or damaged value is a miss, counted in ``errors``, and removed from the store.

Configuration as SGLang's mooncake_store backend reads it, first match wins:
  1. --hicache-storage-backend-extra-config with ``master_server_address`` (and the other keys below);
  2. the JSON file named by $SGLANG_HICACHE_MOONCAKE_CONFIG_PATH;
  3. the environment: MOONCAKE_MASTER (required there), MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_PROTOCOL,
     MOONCAKE_DEVICE, MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_LOCAL_HOSTNAME
     (or LOCAL_HOSTNAME).
Keys and SGLang's defaults: local_hostname "localhost", metadata_server "P2PHANDSHAKE" (or an http:// metadata
URL), global_segment_size 4 GiB (an int of bytes or "<n>gb": the memory this server lends to the store; 0
lends none), local_buffer_size 16 MiB, protocol "tcp" ("rdma" with device_name), master_server_address
"host:port" of ``mooncake_master``.

Faults: the connection is made on a background thread (a Mooncake client gives up on an unreachable master
only after ~90 s). Startup waits ``connect_wait_s`` (extra-config, default 5 s) for it; past that the server
starts with L3 offline (health "degraded", logged), keeps retrying every ``retry_interval_s`` and brings the
tier online when the master answers. A failed call (master gone while serving) is counted, marks the tier
degraded and returns a miss / an unstored page; a call to a dead master takes seconds to fail, so after a
failure only one call per ``retry_interval_s`` tries the store, the others are answered at once; the first call
that succeeds again, or the background health probe (one ``is_exist`` per ``retry_interval_s`` while degraded),
brings the tier back and forgets which pages it had stored (a restarted master has lost them all: backups
write them again).
All calls run on storage_io.py's threads, never on the scheduler's: ``known()`` answers from memory.

Same host (mooncake_shm.py): with ``client_server_address`` ("host:port" of a ``mooncake_client``, Mooncake's
standalone real client that owns the segment; SGLang's key, $MOONCAKE_CLIENT) on this host, the server attaches to
it as a dummy client: pages move through shared memory, copied in memory instead of sent over loopback TCP.
The decision is made at each connect and logged: a real client on another host, ``standalone_storage`` false, or
a real client that refuses (not running) leaves the TCP client to ``master_server_address`` (the fallback; with
no master address the tier stays offline and retries). ``transport`` in stats() says which runs ("shm" or "tcp"),
``shm_reads`` / ``shm_writes`` count the pages that took it. A dummy client never re-attaches to a mooncake_client
that restarted, so after a few failed health probes (which store and remove a probe object: a dummy's is_exist
answers 0 when nothing works) a fresh one is tried and takes over once its probe passes.

Zero-copy (mooncake_memory.py, TCP client): the host (L2) pool the runtime hands over (``register_host_memory``) is
registered with the client once it connects, with a small header area; reads then land each value straight in
a header slot and the rows of the host page reserved for it (``batch_get_into_multi_buffers``), verified in
place, and backups are written from the host page (``batch_put_from_multi_buffers``). Where the client refuses
a registration, reads copy as before (``get_batch``, one copy into the host page); ``read_path`` in stats()
(tiers.storage in /server_info) says which runs, and ``zero_copy_reads`` / ``zero_copy_writes`` count the pages.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

from tierlm.runtime.cache.storage import page_header
from tierlm.runtime.cache.storage.base import BorrowedPage, KVStorage, byte_views, check_page_key, copy_into
from tierlm.runtime.cache.storage.mooncake_memory import RegisteredMemory
from tierlm.runtime.cache.storage.mooncake_shm import SHM, ShmStaging, same_host
from tierlm.runtime.cache.storage.namespace import StorageNamespace
from tierlm.runtime.cache.storage.page_header import HEADER_SIZE
from tierlm.runtime.errors import StartupError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tierlm[mooncake]'"
CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 * 1024**3  # SGLang's defaults
DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024**2
DEFAULT_LOCAL_HOSTNAME = "localhost"
DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_PROTOCOL = "tcp"
DEFAULT_DEVICE_NAME = ""
DEFAULT_CONNECT_WAIT_S = 5.0
DEFAULT_RETRY_INTERVAL_S = 5.0
TCP = "tcp"
RPC_FAIL = -900  # Mooncake's error code of a call whose RPC to the master failed
# A value whose size differs from the buffers (a damaged or foreign value; also a transfer that failed): that key
# is read again as bytes, so the header rules decide, as on the copying path.
SIZE_MISMATCH = (-600, -800)  # BUFFER_OVERFLOW, TRANSFER_FAIL
CLOSE_WAIT_S = 2.0
REATTACH_AFTER_PROBES = 3  # failed health probes of a dummy client before a fresh one is tried
STAGING_WAIT_S = 30.0  # close: a call still copying through a staging area (an abandoned one) before the client goes
MAX_READ_BATCH_PAGES = 32
# Reads into registered memory do not pass through the client's transfer buffer, so one round trip may take more
# pages (fewer metadata RPCs: ~20 % faster for 128 pages on loopback TCP here than 4 batches of 32).
MAX_ZERO_COPY_BATCH_PAGES = 128
MAX_KNOWN_KEYS = 1 << 20  # keys remembered as stored (for known(), which must not touch the network)
KEY_PREFIX = "tierlm"
CONFIG_KEYS = ("master_server_address", "local_hostname", "metadata_server", "global_segment_size",
               "local_buffer_size", "protocol", "device_name", "client_server_address", "standalone_storage")
TIERLM_KEYS = ("connect_wait_s", "retry_interval_s", "io_timeout")  # tierlm's own, extra-config only
SGLANG_IGNORED_KEYS = ("master_metrics_port", "check_server", "extra_backend_tag", "enable_ssd_offload",
                       "ssd_offload_path")
_ENV = {  # config key -> environment variable (SGLang's names)
    "master_server_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "client_server_address": "MOONCAKE_CLIENT",
    "standalone_storage": "MOONCAKE_STANDALONE_STORAGE",
}


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or SGLang's "<n>gb" string (GiB)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            s = value.strip().lower()
            n = int(s[:-2].strip()) * 1024**3 if s.endswith("gb") else int(s)
        else:
            n = int(value)
    except (TypeError, ValueError):
        raise StartupError(f"mooncake {name} must be a number of bytes or \"<n>gb\", got {value!r}") from None
    if n < 0:
        raise StartupError(f"mooncake {name} must be >= 0 bytes, got {value!r}")
    return n


def parse_flag(value: Any, name: str) -> bool | None:
    """None (unset), or a bool from a JSON bool or "true"/"false"/"1"/"0" (an environment variable)."""
    if value is None or isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise StartupError(f"mooncake {name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class MooncakeConfig:
    master_server_address: str
    local_hostname: str = DEFAULT_LOCAL_HOSTNAME
    metadata_server: str = DEFAULT_METADATA_SERVER
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    protocol: str = DEFAULT_PROTOCOL
    device_name: str = DEFAULT_DEVICE_NAME
    client_server_address: str = ""  # a mooncake_client ("host:port"): on this host, pages move through shm
    standalone_storage: bool | None = None  # SGLang's switch for it: False keeps the TCP client
    source: str = "extra-config"  # where it came from, for the log

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], source: str) -> "MooncakeConfig":
        master = cfg.get("master_server_address") or ""
        client = cfg.get("client_server_address") or ""
        if not isinstance(master, str) or not isinstance(client, str) or not (master or client):
            raise StartupError(f"mooncake: {source} has no master_server_address (\"host:port\" of mooncake_master) "
                               "nor client_server_address (\"host:port\" of a mooncake_client on this host)")
        protocol = str(cfg.get("protocol") or DEFAULT_PROTOCOL)
        if protocol not in ("tcp", "rdma"):
            raise StartupError(f"mooncake protocol must be tcp or rdma, got {protocol!r} ({source})")
        return cls(
            master_server_address=master,
            local_hostname=str(cfg.get("local_hostname") or DEFAULT_LOCAL_HOSTNAME),
            metadata_server=str(cfg.get("metadata_server") or DEFAULT_METADATA_SERVER),
            global_segment_size=parse_size(cfg.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
                                           "global_segment_size"),
            local_buffer_size=parse_size(cfg.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE), "local_buffer_size"),
            protocol=protocol,
            device_name=str(cfg.get("device_name") or DEFAULT_DEVICE_NAME),
            client_server_address=client,
            standalone_storage=parse_flag(cfg.get("standalone_storage"), "standalone_storage"),
            source=source,
        )

    @classmethod
    def resolve(cls, extra_config: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> "MooncakeConfig":
        """SGLang's order: extra-config with master_server_address, then $SGLANG_HICACHE_MOONCAKE_CONFIG_PATH,
        then the MOONCAKE_* environment variables."""
        extra = dict(extra_config or {})
        env = os.environ if env is None else env
        if extra.get("master_server_address") is not None or extra.get("client_server_address") is not None:
            return cls.from_mapping(extra, "--hicache-storage-backend-extra-config")
        path = env.get(CONFIG_PATH_ENV, "").strip()
        if path:
            try:
                with open(os.path.expanduser(path), encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise StartupError(f"mooncake: cannot read the JSON config {path} (${CONFIG_PATH_ENV}): {e}") from e
            if not isinstance(cfg, dict):
                raise StartupError(f"mooncake: {path} (${CONFIG_PATH_ENV}) must hold a JSON object")
            return cls.from_mapping(cfg, f"${CONFIG_PATH_ENV} ({path})")
        if not env.get("MOONCAKE_MASTER") and not env.get("MOONCAKE_CLIENT"):
            raise StartupError(
                "--hicache-storage-backend mooncake needs the address of mooncake_master: "
                "--hicache-storage-backend-extra-config '{\"master_server_address\": \"host:50051\"}', "
                f"a JSON file named by ${CONFIG_PATH_ENV}, or MOONCAKE_MASTER=host:50051 (docs/hicache.md)")
        cfg = {key: env[var] for key, var in _ENV.items() if env.get(var)}
        if "local_hostname" not in cfg and env.get("LOCAL_HOSTNAME"):
            cfg["local_hostname"] = env["LOCAL_HOSTNAME"]
        return cls.from_mapping(cfg, "MOONCAKE_* environment variables")

    def describe(self) -> str:
        d = asdict(self)
        return ", ".join(f"{k}={d[k]!r}" for k in CONFIG_KEYS)

    def shm_wanted(self) -> bool | str:
        """True when pages should move through a mooncake_client on this host (mooncake_shm.py), else why not."""
        if not self.client_server_address:
            return "no client_server_address (a mooncake_client on this host)"
        if self.standalone_storage is False:
            return "standalone_storage is false"
        local = same_host(self.client_server_address)
        return True if local is True else f"mooncake_client {self.client_server_address} is not on this host ({local})"


def import_store_class() -> type:
    """mooncake.store.MooncakeDistributedStore, or a StartupError with the install command."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        msg = str(e)
        if "ibverbs" in msg:
            raise StartupError(f"--hicache-storage-backend mooncake: the mooncake package needs the libibverbs "
                               f"shared library, even over TCP ({msg}): apt-get install -y libibverbs1") from e
        raise StartupError(f"--hicache-storage-backend mooncake needs the Mooncake Store client ({msg}): "
                           f"{INSTALL_HINT}") from e
    return MooncakeDistributedStore


class MooncakeKVStorage(KVStorage):
    """KVStorage on Mooncake Store; see the module docstring. ``store_class``: MooncakeDistributedStore (tests)."""

    name = "mooncake"
    probe_wait_s = 0.2  # a metadata round trip to the master and a transfer: tens of ms on a busy 2-core machine
    shared = True  # every server of the model reads and writes the same pages

    def __init__(self, config: MooncakeConfig, namespace: StorageNamespace, page_bytes: int, *,
                 connect_wait_s: float = DEFAULT_CONNECT_WAIT_S, retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
                 store_class: type | None = None, max_known: int = MAX_KNOWN_KEYS) -> None:
        if not isinstance(page_bytes, int) or page_bytes < 1:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        self.config = config
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.value_bytes = HEADER_SIZE + page_bytes
        # Prefetch pages per get_batch (one metadata round trip for all): up to 32, and no more than half the
        # client's transfer buffer holds (a batch larger than the buffer comes back with values missing).
        self.copy_batch_pages = max(1, min(MAX_READ_BATCH_PAGES, config.local_buffer_size // 2 // self.value_bytes))
        self.retry_interval_s = float(retry_interval_s)
        self._ns_raw = namespace.id_bytes
        self._prefix = f"{KEY_PREFIX}_{self._ns_raw.hex()}_"
        self.location = f"mooncake://{config.master_server_address or config.client_server_address}/" \
                        f"{namespace.folder_name}"
        self._store_class = store_class or import_store_class()
        self._store: Any = None  # the connected client; None while offline
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._max_known = max_known
        self._counts = dict(reads=0, writes=0, bytes_read=0, bytes_written=0, misses=0, errors=0, evictions=0,
                            zero_copy_reads=0, zero_copy_writes=0, shm_reads=0, shm_writes=0)
        self._memory = RegisteredMemory(MAX_ZERO_COPY_BATCH_PAGES)  # the host pool and header slots (zero-copy)
        self._staging = ShmStaging(self.value_bytes, MAX_ZERO_COPY_BATCH_PAGES)  # the same-host path's areas
        self._shm_wanted = config.shm_wanted()  # True, or why pages move over TCP
        self._transport: str | None = None  # SHM or TCP once connected
        self._shm_refused: str | None = None  # why the last shm attempt failed (the TCP fallback then runs)
        self._read_ns = 0
        self._checksum_ns = 0  # parts of _read_ns: verifying pages, copying them into the caller's buffers
        self._copy_ns = 0
        self._retry_at: float | None = None  # after a failed call: when the next call may try the store
        self._degraded: str | None = "connecting to the Mooncake master"
        self._last_error: str | None = None
        self._closed = False
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._connect_loop, name="tierlm-mooncake-connect", daemon=True)
        if self._shm_wanted is not True and config.client_server_address:
            logger.info("L3 Mooncake: pages move over %s to master %s, not through shared memory: %s", config.protocol,
                        config.master_server_address, self._shm_wanted)
        self._thread.start()
        if not self._connected.wait(connect_wait_s):
            logger.warning(
                "L3 Mooncake store OFFLINE at startup: master %s did not answer within %g s; serving without L3 and "
                "retrying in the background (start mooncake_master, check master_server_address)",
                config.master_server_address, connect_wait_s)

    # --- connection ---
    def _connect_loop(self) -> None:
        c, attempt = self.config, 0
        while not self._stop.is_set():
            attempt += 1
            t0 = time.monotonic()
            store, transport, why = None, SHM, ""
            if self._shm_wanted is True:
                store, why = self._setup_shm()
                if store is None and c.master_server_address and why != self._shm_refused:
                    logger.warning("L3 Mooncake: the same-host shared-memory path is refused (%s); pages move over "
                                   "%s to master %s instead (start mooncake_client, then restart this server to use "
                                   "it)", why, c.protocol, c.master_server_address)
                self._shm_refused = why or None
            if store is None and c.master_server_address:
                store, why = self._setup_tcp()
                transport = TCP
            if store is not None:
                with self._lock:
                    if self._closed:
                        _close_quietly(store)
                        return
                    self._store, self._transport = store, transport
                    self._degraded = None
                if transport == SHM:
                    self._staging.attach(store)
                else:  # after self._store is set, so a region register_host_memory adds meanwhile is registered by
                    self._memory.register(store)  # one of the two; calls made before this copy (read_path says so)
                self._connected.set()
                logger.info("L3 Mooncake store online: connected to %s in %.2f s (attempt %d); pages move %s",
                            f"mooncake_client {c.client_server_address} (same host)" if transport == SHM
                            else f"master {c.master_server_address}", time.monotonic() - t0, attempt,
                            self.read_path)
                self._watch(store)
                return
            self._offline(why, attempt)

    def _setup_shm(self) -> tuple[Any, str]:
        """A dummy client of the mooncake_client on this host, or (None, why not)."""
        address = self.config.client_server_address
        reachable = _port_open(address)
        if reachable is not True:
            return None, f"mooncake_client {address} unreachable ({reachable})"
        store = self._store_class()
        try:
            rc = store.setup_dummy(self._staging.max_slots * self._staging.slot_pages * self.value_bytes,
                                   self.config.local_buffer_size, address)
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and friends
            rc = f"{type(e).__name__}: {e}"
        return (store, "") if rc == 0 else (None, f"mooncake_client {address} refused a dummy client "
                                                  f"(setup_dummy returned {rc})")

    def _setup_tcp(self) -> tuple[Any, str]:
        """A client of the master (lending global_segment_size bytes), or (None, why not)."""
        c = self.config
        # A Mooncake client retries an unreachable master for ~90 s inside setup(), and may hold the GIL
        # meanwhile (seen with 0.3.13): setup() is only called once the master's port accepts connections.
        reachable = _port_open(c.master_server_address)
        if reachable is not True:
            return None, f"Mooncake master {c.master_server_address} unreachable ({reachable})"
        store = self._store_class()
        try:
            rc = store.setup(c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size,
                             c.protocol, c.device_name, c.master_server_address)
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and friends
            rc = f"{type(e).__name__}: {e}"
        return (store, "") if rc == 0 else (
            None, f"cannot connect to Mooncake master {c.master_server_address} (setup returned {rc})")

    def _watch(self, store: Any) -> None:
        """While degraded, probe the master once per retry_interval_s on this thread, so the tier comes back when
        the master does even if no request happens to touch L3 (a server whose traffic all hits L1/L2)."""
        probe = self._prefix + "probe"
        failed_probes = 0
        while not self._stop.wait(self.retry_interval_s):
            if self._retry_at is None:
                failed_probes = 0
                continue  # healthy
            # Over TCP a data call that wins the retry slot probes as well as this thread; on the shm path this
            # thread probes every interval whatever the traffic does, so failures add up to a re-attach even
            # while failing backups keep taking the slot (and shm reads that fail count as misses, not failures).
            if self._transport != SHM and self._client() is None:
                continue
            rc = self._probe(store, probe)
            if rc is not None and rc >= 0:
                self._ok()
                failed_probes = 0
                continue
            if rc is not None:
                self._failed(f"the health probe returned {rc}")
            failed_probes += 1
            if self._transport == SHM and failed_probes >= REATTACH_AFTER_PROBES:
                store = self._reattach(store, probe)

    def _probe(self, store: Any, probe: str) -> int | None:
        """The health probe's code (>= 0: the store answers), None if the client raised. Over TCP an is_exist; a
        dummy client stores and removes a probe object, as its is_exist answers 0 when the mooncake_client behind
        it restarted (or the master is down) and nothing can be read or written."""
        if self._transport != SHM:
            return self._call(lambda: store.is_exist(probe), "is_exist (health probe)")
        rc = self._call(lambda: store.upsert(probe, b"1"), "upsert (health probe)")
        if rc == 0:
            self._call(lambda: store.remove(probe, True), "remove (health probe)")
        return rc

    def _reattach(self, old: Any, probe: str) -> Any:
        """A dummy client never re-attaches to a mooncake_client that restarted: while the old one fails, a fresh
        one is tried, and takes over once its probe passes. The client to use from now on."""
        new, _ = self._setup_shm()
        rc = None if new is None else self._probe(new, probe)
        if new is None or rc != 0:
            if new is not None:
                _close_quietly(new)  # the real client answers but the store behind it does not: keep waiting
            return old
        with self._lock:
            if self._closed:
                _close_quietly(new)
                return old
            self._store = new
        self._staging.attach(new)
        self._ok()
        logger.info("L3 Mooncake: attached again to mooncake_client %s (it restarted)",
                    self.config.client_server_address)

        def retire() -> None:  # a call may still hold one of its staging areas
            if self._staging.wait_idle(STAGING_WAIT_S, old):
                _close_quietly(old)

        threading.Thread(target=retire, name="tierlm-mooncake-retire", daemon=True).start()
        return new

    def _offline(self, why: str, attempt: int) -> None:
        """A connection attempt failed: say why (a warning the first time) and wait before the next one."""
        with self._lock:
            self._degraded = self._last_error = why
        logger.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                   "L3 Mooncake store offline: %s; retrying every %g s", why, self.retry_interval_s)
        self._stop.wait(self.retry_interval_s)

    @property
    def online(self) -> bool:
        return self._store is not None

    def register_host_memory(self, buf: Any) -> None:
        """Pages are read into and written from ``buf`` (the host pool): registered with the client now, or once
        it connects."""
        self._memory.add(buf)
        store = self._store
        if store is not None and self._transport == TCP:  # a dummy client registers only its own shared memory
            self._memory.register(store)
        logger.info("L3 Mooncake reads and writes: %s", self.read_path)

    @property
    def read_path(self) -> str:
        """"shm (...)", "zero-copy" or "copy (why)": how pages move between the store and the host pool."""
        if self._transport == SHM:
            refused = self._staging.refused
            return (f"copy (shm client; {refused})" if refused else
                    f"shm (mooncake_client {self.config.client_server_address} on this host, staged in shared memory)")
        return self._memory.path(self._store)

    @property
    def read_batch_pages(self) -> int:  # type: ignore[override]  # depends on the path that runs
        if self._transport == SHM:
            return self._staging.slot_pages
        return MAX_ZERO_COPY_BATCH_PAGES if self._memory.ready(self._store) else self.copy_batch_pages

    def object_key(self, key: str) -> str:
        return self._prefix + key

    # --- KVStorage, plus exists() and delete() of this backend's own (tests and tools) ---
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored, asked of the master (one round trip); updates what known() answers."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        store = self._client()
        if store is None or not keys:
            return [False] * len(keys)
        res = self._call(lambda: store.batch_is_exist([self.object_key(k) for k in keys]), "batch_is_exist")
        if res is None:
            return [False] * len(keys)
        out = [r == 1 for r in res]
        if any(r < 0 for r in res):
            self._failed(f"batch_is_exist of {len(keys)} keys returned errors {sorted(set(r for r in res if r < 0))}")
        else:
            self._ok()
        with self._lock:
            for key, hit in zip(keys, out):
                if hit:
                    self._remember_locked(key)
                else:
                    self._known.pop(key, None)
        return out

    def known(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._known for key in keys]

    def get(self, key: str) -> bytes | None:
        return self._read(key, absent_is_miss=True)

    def probe(self, key: str) -> bytes | None:
        return self._read(key, absent_is_miss=False)

    def _batch_client(self, keys: Sequence[str], probe: bool) -> Any:
        """The client for a batch read of ``keys`` (checked), or None when the store is unreachable (counted)."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        store = self._client()
        if store is None:
            self._count(misses=0 if probe else min(1, len(keys)))
        return store

    def batch_read(self, keys: Sequence[str], *, probe: bool = False) -> list[bytes | None]:
        store = self._batch_client(keys, probe)
        if store is None:
            return [None] * len(keys)
        pages = self._get_batch(store, keys, absent_is_miss=not probe)
        got = list(itertools.takewhile(lambda page: page is not None, pages))
        return got + [None] * (len(keys) - len(got))

    def get_into(self, key: str, out: Sequence[Any], *, probe: bool = False) -> bool:
        return self.batch_get_into([key], [out], probe=probe)[0]

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[Sequence[Any]], *, probe: bool = False
                       ) -> list[bool]:
        """batch_read's one round trip, each page landing in its buffers: straight from the store when they are
        registered memory, else copied once from the value the client returned; stops at the first page not read."""
        store = self._batch_client(keys, probe)
        if store is None:
            return [False] * len(keys)
        if self._transport == SHM:
            got = self._get_staged(store, keys, outs, absent_is_miss=not probe)
            if got is not None:
                return got
        elif self._memory.ready(store):
            got = self._get_registered(store, keys, outs, absent_is_miss=not probe)
            if got is not None:
                return got
        got = []
        for page, out in zip(self._get_batch(store, keys, absent_is_miss=not probe, as_bytes=False), outs):
            if page is None:
                break
            self._timed_copy(page, out)
            got.append(True)
        return got + [False] * (len(keys) - len(got))

    def _timed_copy(self, value: Any, out: Sequence[Any]) -> None:
        """copy_into, its time counted as copy time and as read time (the read is not done until it lands)."""
        t0 = time.perf_counter_ns()
        copy_into(value, out)
        copy_ns = time.perf_counter_ns() - t0
        with self._lock:
            self._copy_ns += copy_ns
            self._read_ns += copy_ns

    def _multi_buffer_read(self, store: Any, keys: Sequence[str], addresses: list[list[int]],
                           sizes: list[list[int]], absent_is_miss: bool) -> tuple[list[int] | None, int]:
        """One batch_get_into_multi_buffers round trip: (each key's result code, or None when the call raised and
        the batch counts as missed; the round trip's time shared by its pages, in ns)."""
        t0 = time.perf_counter_ns()
        rcs = self._call(lambda: store.batch_get_into_multi_buffers(
            [self.object_key(k) for k in keys], addresses, sizes), "batch_get_into_multi_buffers")
        if rcs is None:
            self._count(misses=len(keys) if absent_is_miss else 0)
        elif any(rc == self.value_bytes for rc in rcs):
            self._ok()
        return rcs, (time.perf_counter_ns() - t0) // max(1, len(keys))

    def _get_registered(self, store: Any, keys: Sequence[str], outs: Sequence[Sequence[Any]], absent_is_miss: bool
                        ) -> list[bool] | None:
        """batch_get_into on registered memory: one round trip lands each value's header in a header slot and its
        payload in ``outs``, verified there. None (nothing read) when a buffer is not registered memory or no header
        slot is free: the caller copies instead."""
        if len(keys) * HEADER_SIZE > self._memory.slot_bytes:
            return None  # more pages than read_batch_pages, which the header slots are sized for
        views = [[memoryview(b).cast("B") for b in out] for out in outs]
        ptrs = [self._memory.addresses(v) for v in views]
        if any(p is None for p in ptrs):
            return None
        for v in views:
            if sum(b.nbytes for b in v) != self.page_bytes:
                raise ValueError(f"get_into got buffers of {sum(b.nbytes for b in v)} bytes for a "
                                 f"{self.page_bytes}-byte page")
        with self._memory.header_slot() as slot:
            if slot is None:
                return None
            headers, base = slot
            addresses = [[base + i * HEADER_SIZE, *p] for i, p in enumerate(ptrs)]  # header slot, then the page
            rcs, share = self._multi_buffer_read(store, keys, addresses,
                                                 [[HEADER_SIZE, *(b.nbytes for b in v)] for v in views], absent_is_miss)
            if rcs is None:
                return [False] * len(keys)

            def in_place(i: int, key: str, size: int) -> bool:
                header = memoryview(headers)[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]
                return self._verified(key, header, views[i], size, share, path="zero_copy_reads")

            return self._landed(keys, rcs, outs, absent_is_miss, in_place)

    def _get_staged(self, store: Any, keys: Sequence[str], outs: Sequence[Sequence[Any]], absent_is_miss: bool
                    ) -> list[bool] | None:
        """The same-host read: one call lands each whole value in a staging area of the dummy client's shared memory
        (copied there by the mooncake_client that holds it), verified there, then copied once into ``outs``. None
        (nothing read) when no staging area is free or the batch is larger than one: the caller copies instead."""
        vb = self.value_bytes
        if len(keys) > self._staging.slot_pages:
            return None
        with self._staging.slot(store) as area:
            if area is None:
                return None
            staged, base = area
            rcs, share = self._multi_buffer_read(store, keys, [[base + i * vb] for i in range(len(keys))],
                                                 [[vb]] * len(keys), absent_is_miss)
            if rcs is None:
                return [False] * len(keys)

            def staged_copy(i: int, key: str, size: int) -> bool:
                value = memoryview(staged)[i * vb:(i + 1) * vb]
                if not self._verified(key, value[:HEADER_SIZE], [value[HEADER_SIZE:]], size, share, path="shm_reads"):
                    return False
                self._timed_copy(value[HEADER_SIZE:], outs[i])
                return True

            return self._landed(keys, rcs, outs, absent_is_miss, staged_copy)

    def _landed(self, keys: Sequence[str], rcs: Sequence[int], outs: Sequence[Sequence[Any]], absent_is_miss: bool,
                accept: Callable[[int, str, int], bool]) -> list[bool]:
        """The pages of a batch read into memory, from each key's result code: a whole value is checked (and copied
        where it must be) by ``accept(i, key, size)``; a value of another size is read again as bytes, so a damaged
        one is removed and counted; anything else is a miss. Stops at the first page not read."""
        got: list[bool] = []
        for i, (key, rc) in enumerate(zip(keys, rcs)):
            if rc == self.value_bytes:
                ok = accept(i, key, rc)
            elif rc in SIZE_MISMATCH:  # read it as bytes: a damaged value is then removed and counted
                page = self._read(key, absent_is_miss)
                ok = page is not None
                if ok:
                    copy_into(page, outs[i])
            else:  # absent (-704 OBJECT_NOT_FOUND), or the master unreachable: a miss, as get_batch's b""
                self._accept(key, b"", absent_is_miss, 0)
                ok = False
            if not ok:
                break
            got.append(True)
        return got + [False] * (len(keys) - len(got))

    def _get_batch(self, store: Any, keys: Sequence[str], absent_is_miss: bool, as_bytes: bool = True
                   ) -> list[Any]:
        """The verified payloads of ``keys`` (bytes, or views of the values the client returned), None where not
        read; asked copy_batch_pages at a time (what the client's transfer buffer holds), until one is missing."""
        out: list[Any] = []
        step = self.copy_batch_pages
        for start in range(0, len(keys), step):
            part = self._get_values(store, keys[start:start + step], absent_is_miss, as_bytes)
            out += part
            if any(page is None for page in part):
                break
        return out + [None] * (len(keys) - len(out))

    def _get_values(self, store: Any, keys: Sequence[str], absent_is_miss: bool, as_bytes: bool) -> list[Any]:
        """_get_batch of at most copy_batch_pages keys: one get_batch round trip."""
        t0 = time.perf_counter_ns()
        values = self._call(lambda: store.get_batch([self.object_key(k) for k in keys]), "get_batch")
        if values is None:
            self._count(misses=len(keys) if absent_is_miss else 0)
            return [None] * len(keys)
        if any(values):  # the client answers b"" for a failure too: only a value proves the store works
            self._ok()
        share = (time.perf_counter_ns() - t0) // max(1, len(keys))  # one round trip, shared by its pages
        return [self._accept(k, v, absent_is_miss, share, as_bytes) for k, v in zip(keys, values)]

    def _read(self, key: str, absent_is_miss: bool) -> bytes | None:
        self._check_open()
        self._check_key(key)
        store = self._client()
        if store is None:
            self._count(misses=int(absent_is_miss))
            return None
        t0 = time.perf_counter_ns()
        value = self._call(lambda: store.get(self.object_key(key)), "get")
        if value is None:
            self._count(misses=1)
            return None
        if value:  # the client answers b"" for a failure too: only a value proves the store works
            self._ok()
        return self._accept(key, value, absent_is_miss, time.perf_counter_ns() - t0)

    def _accept(self, key: str, value: bytes, absent_is_miss: bool, read_ns: int, as_bytes: bool = True) -> Any:
        """The verified payload of ``value`` read for ``key`` (bytes, or a view into ``value`` when not
        ``as_bytes``); None (a miss) when absent or unusable. ``read_ns``: the time its transfer took (the
        checksum's time is added here)."""
        if not value:  # the client answers b"" for an absent key
            with self._lock:
                self._known.pop(key, None)
                self._counts["misses"] += int(absent_is_miss)
            return None
        view = memoryview(value)
        payload = view[HEADER_SIZE:]
        if not self._verified(key, view[:HEADER_SIZE], [payload], len(value), read_ns):
            return None
        return bytes(payload) if as_bytes else payload

    def _verified(self, key: str, header: memoryview, views: Sequence[memoryview], size: int, read_ns: int,
                  path: str | None = None) -> bool:
        """Whether the ``size``-byte value read for ``key`` (``header``, then ``views``) is its intact page: counted
        as a read (and in the ``path`` counter), else removed from the store and counted as an error and a miss.
        ``read_ns``: its transfer's time (the checksum's is added here)."""
        t0 = time.perf_counter_ns()
        problem = page_header.verify(header, size, size, key=key, ns_raw=self._ns_raw,
                                     ns_label=self.namespace.folder_name, page_bytes=self.page_bytes, views=views)
        checked = time.perf_counter_ns()
        if problem is not None:
            self._discard(key, problem)
            return False
        with self._lock:
            self._remember_locked(key)
            self._counts["reads"] += 1
            if path is not None:
                self._counts[path] += 1
            self._counts["bytes_read"] += self.page_bytes
            self._read_ns += read_ns + checked - t0
            self._checksum_ns += checked - t0
        return True

    def set(self, key: str, payload: Any) -> bool:
        """Store a page (a buffer, a list of buffers, or a BorrowedPage) as header + payload, without joining the
        buffers. A key already stored (by this or another server) is left as it is: True."""
        self._check_open()
        self._check_key(key)
        valid = payload.valid if isinstance(payload, BorrowedPage) else None
        views = byte_views(payload)
        nbytes = sum(v.nbytes for v in views)
        if nbytes != self.page_bytes:
            raise ValueError(f"payload for {key[:12]}.. has {nbytes} bytes, this storage stores {self.page_bytes}")
        store = self._client()
        if store is None:
            return False
        with self._lock:
            if key in self._known:
                self._known.move_to_end(key)
                return True
        header = page_header.pack_header(self._ns_raw, key, views)
        if valid is not None and not valid():
            return False
        obj = self.object_key(key)
        rc = self._put(store, obj, header, views)
        if rc == RPC_FAIL:  # the first call after a master restart fails on the old connection; the next reconnects
            rc = self._put(store, obj, header, views)
        if rc is None:
            return False
        if rc != 0:
            if self._call(lambda: store.is_exist(obj), "is_exist") == 1:  # stored meanwhile by another server
                self._ok()
                with self._lock:
                    self._remember_locked(key)
                return True
            self._failed(f"put of {obj[:40]}.. returned {rc}")
            return False
        if valid is not None and not valid():  # the page's memory was reused while it was sent: do not keep it
            self._call(lambda: store.remove(obj, True), "remove")
            return False
        self._ok()
        with self._lock:
            self._remember_locked(key)
            self._counts["writes"] += 1
            self._counts["bytes_written"] += self.value_bytes
        return True

    def _put(self, store: Any, obj: str, header: bytes, views: Sequence[memoryview]) -> int | None:
        """Store header + ``views`` as ``obj``: from registered memory when the views are in it (the host pool), from
        a staging area on the same-host path, else through put_parts (which copies them into the client's buffer).
        The client's code, None if it raised."""
        if self._transport == SHM:
            with self._staging.slot(store) as area:
                if area is not None:
                    staged = memoryview(area[0])
                    staged[:HEADER_SIZE] = memoryview(header)
                    pos = HEADER_SIZE
                    for v in views:
                        staged[pos:pos + v.nbytes] = v.cast("B")
                        pos += v.nbytes
                    rc = self._call(lambda: store.put_from(obj, area[1], pos), "put")
                    if rc == 0:
                        self._count(shm_writes=1)
                    return rc
        ptrs = self._memory.addresses(views) if self._memory.ready(store) else None
        if ptrs is not None:
            with self._memory.header_slot() as slot:
                if slot is not None:
                    slot[0][:HEADER_SIZE] = memoryview(header)
                    rcs = self._call(lambda: store.batch_put_from_multi_buffers(
                        [obj], [[slot[1], *ptrs]], [[HEADER_SIZE, *(v.nbytes for v in views)]]), "put")
                    if rcs is not None and rcs[0] == 0:
                        self._count(zero_copy_writes=1)
                    return None if rcs is None else rcs[0]
        return self._call(lambda: store.put_parts(obj, header, *views), "put")

    def delete(self, key: str) -> bool:
        self._check_open()
        self._check_key(key)
        with self._lock:
            self._known.pop(key, None)
        store = self._store
        if store is None:
            return False
        rc = self._call(lambda: store.remove(self.object_key(key), True), "remove")
        return rc == 0

    def clear(self) -> int:
        """Remove every object of this namespace from the whole store (every server sharing it loses them)."""
        self._check_open()
        with self._lock:
            self._known.clear()
        store = self._store
        if store is None:
            logger.warning("L3 Mooncake store %s is offline: nothing cleared there", self.location)
            return 0
        removed = self._call(lambda: store.remove_by_regex(f"^{self._prefix}[0-9a-f]{{64}}$", True), "remove_by_regex")
        removed = max(0, removed or 0)
        logger.info("cleared L3 Mooncake store %s: removed %d pages", self.location, removed)
        return removed

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"files": len(self._known), "bytes": len(self._known) * self.value_bytes}
            out.update(self._counts)
            out["read_seconds"] = self._read_ns / 1e9
            out["checksum_seconds"] = self._checksum_ns / 1e9
            out["copy_seconds"] = self._copy_ns / 1e9
        out["max_bytes"] = None  # the store's size is the sum of the segments its clients lend
        out["backend"] = self.name  # tiers.storage in /server_info
        out["read_path"] = self.read_path  # "shm (...)", "zero-copy", or "copy (why)"
        out["transport"] = self._transport  # "shm" (a mooncake_client on this host) or "tcp"
        out["master"] = self.config.master_server_address
        out["connected"] = self.online
        return out

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {"state": "online" if self._degraded is None else "degraded",
                    "last_error": self._last_error or self._degraded}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        self._stop.set()
        if store is not None:  # unmounting from a dead master takes the client ~10 s: shutdown waits 2 s at most
            def close_after_probe() -> None:
                self._thread.join()  # a health probe in flight finishes (or fails) before the client goes away
                if not self._staging.wait_idle(STAGING_WAIT_S):  # the client frees the staging areas' memory
                    logger.warning("L3 Mooncake: a call still uses a shared-memory staging area; its client is left "
                                   "open")
                    return
                _close_quietly(store)

            t = threading.Thread(target=close_after_probe, name="tierlm-mooncake-close", daemon=True)
            t.start()
            t.join(CLOSE_WAIT_S)

    # --- internals ---
    def _client(self) -> Any:
        """The connected client, or None while offline or while calls fail: after a failed call (the master
        is gone: a call then takes seconds to fail) only one call per retry_interval_s tries again, the
        others are answered at once as misses / unstored pages."""
        store = self._store
        if store is None or self._retry_at is None:
            return store
        now = time.monotonic()
        with self._lock:
            if self._retry_at is not None and now < self._retry_at:
                return None
            if self._retry_at is not None:
                self._retry_at = now + self.retry_interval_s  # this caller tries; the rest wait for it
        return store

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        """fn() or None when the client raised (counted as a failure)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self._failed(f"{what} raised {type(e).__name__}: {e}")
            return None

    def _failed(self, what: str) -> None:
        with self._lock:
            self._counts["errors"] += 1
            first = self._degraded is None
            self._degraded = self._last_error = what
            self._retry_at = time.monotonic() + self.retry_interval_s
        logger.log(logging.WARNING if first else logging.DEBUG,
                   "L3 Mooncake store degraded: %s; serving from the memory tiers until a call succeeds again "
                   "(master %s)", what, self.config.master_server_address)

    def _ok(self) -> None:
        if self._degraded is None:
            return
        with self._lock:
            was, self._degraded = self._degraded, None
            self._retry_at = None
            # The master may have restarted meanwhile and lost every page: forget what was stored, so backups
            # write pages again and reads probe instead of trusting a stale index.
            self._known.clear()
        if was is not None:
            logger.info("L3 Mooncake store %s is back online (last error: %s)", self.location, was)

    def _discard(self, key: str, reason: str) -> None:
        logger.warning("L3 Mooncake object %s is unusable (%s): removed it, serving a miss",
                       self.object_key(key)[:48] + "..", reason)
        with self._lock:
            self._known.pop(key, None)
            self._counts["errors"] += 1
            self._counts["misses"] += 1
        store = self._store
        if store is not None:
            try:
                store.remove(self.object_key(key), True)
            except Exception as e:  # noqa: BLE001
                logger.debug("could not remove %s: %s", key, e)

    def _remember_locked(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MooncakeKVStorage {self.location} is closed; open a new one")

    _check_key = staticmethod(check_page_key)


def _port_open(address: str, timeout: float = 1.0) -> bool | str:
    """True when host:port accepts a TCP connection (or the address is not one host:port, e.g. Mooncake's HA
    form "etcd://host:port;..."), else why not."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address or ";" in address:
        return True
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout):
            return True
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception as e:  # noqa: BLE001
        logger.debug("closing the Mooncake client: %s", e)


def open_storage(namespace: StorageNamespace, page_bytes: int, extra_config: Mapping[str, Any]
                 ) -> MooncakeKVStorage:
    """The 'mooncake' backend of registry.py."""
    cfg = dict(extra_config or {})
    store_class = import_store_class()  # the install hint before any config question
    unknown = sorted(set(cfg) - set(CONFIG_KEYS) - set(TIERLM_KEYS) - set(SGLANG_IGNORED_KEYS))
    if unknown:
        logger.warning("mooncake storage ignores extra-config keys %s (it knows %s)", unknown,
                       list(CONFIG_KEYS + TIERLM_KEYS))
    try:
        connect_wait = float(cfg.get("connect_wait_s", DEFAULT_CONNECT_WAIT_S))
        retry = float(cfg.get("retry_interval_s", DEFAULT_RETRY_INTERVAL_S))
    except (TypeError, ValueError) as e:
        raise StartupError(f"mooncake connect_wait_s / retry_interval_s must be numbers of seconds: {e}") from e
    config = MooncakeConfig.resolve(cfg)
    logger.info("L3 Mooncake store config from %s: %s", config.source, config.describe())
    return MooncakeKVStorage(config, namespace, page_bytes, connect_wait_s=connect_wait,
                             retry_interval_s=max(0.1, retry), store_class=store_class)
