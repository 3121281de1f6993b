"""The Mooncake store's connection: the client (imported only when the store is chosen), made on a background
thread, over TCP to the master or, on the same host, as a dummy client of a ``mooncake_client`` (shm.py).

A Mooncake client gives up on an unreachable master only after ~90 s, so the connection is made on a thread:
startup waits ``connect_wait_s`` (extra-config, default 5 s) for it; past that the server starts with L3 offline
(health "degraded", logged), keeps retrying every ``retry_interval_s`` and brings the tier online when the master
answers. Once connected the same thread runs the health watch (health.py).

The same-host decision is made at each connect and logged: a real client on another host, ``standalone_storage``
false, or a real client that refuses (not running) leaves the TCP client to ``master_server_address`` (the
fallback; with no master address the tier stays offline and retries).
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from tierlm.runtime.cache.storage.base import PageBuffer
from tierlm.runtime.cache.storage.stores.mooncake.client import ClientFactory, MooncakeClient
from tierlm.runtime.cache.storage.stores.mooncake.config import MooncakeConfig
from tierlm.runtime.cache.storage.stores.mooncake.health import Health, probe, watch
from tierlm.runtime.cache.storage.stores.mooncake.memory import RegisteredMemory
from tierlm.runtime.cache.storage.stores.mooncake.shm import SHM, ShmStaging
from tierlm.runtime.errors import StartupError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tierlm[mooncake]'"
TCP = "tcp"
CLOSE_WAIT_S = 2.0
STAGING_WAIT_S = 30.0  # close: a call still copying through a staging area (an abandoned one) before the client goes


def import_store_class() -> ClientFactory:
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
    factory: ClientFactory = MooncakeDistributedStore  # untyped bindings: typed here, at the door
    return factory


class Connection:
    """The client of one Mooncake store: ``store`` (None while offline), how pages move (``transport``), the memory
    registered with it (``memory``, TCP) or its staging areas (``staging``, same host), and the thread that connects
    and then watches its health."""

    def __init__(self, config: MooncakeConfig, health: Health, value_bytes: int, batch_pages: int,
                 client_factory: ClientFactory, probe_key: str) -> None:
        self.config = config
        self.health = health
        self.value_bytes = value_bytes
        self.memory = RegisteredMemory(batch_pages)  # the host pool and header slots (zero-copy)
        self.staging = ShmStaging(value_bytes, batch_pages)  # the same-host path's areas
        self.store: MooncakeClient | None = None  # the connected client; None while offline
        self.transport: str | None = None  # SHM or TCP once connected
        self.shm_wanted = config.shm_wanted()  # True, or why pages move over TCP
        self.shm_refused: str | None = None  # why the last shm attempt failed (the TCP fallback then runs)
        self.closed = False
        self._client_factory = client_factory
        self._probe_key = probe_key
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._connect_loop, name="tierlm-mooncake-connect", daemon=True)

    def start(self, connect_wait_s: float) -> None:
        """Connect on the background thread, waiting at most ``connect_wait_s`` for it (then offline, retrying)."""
        c = self.config
        if self.shm_wanted is not True and c.client_server_address:
            logger.info("L3 Mooncake: pages move over %s to master %s, not through shared memory: %s", c.protocol,
                        c.master_server_address, self.shm_wanted)
        self._thread.start()
        if not self._connected.wait(connect_wait_s):
            logger.warning(
                "L3 Mooncake store OFFLINE at startup: master %s did not answer within %g s; serving without L3 and "
                "retrying in the background (start mooncake_master, check master_server_address)",
                c.master_server_address, connect_wait_s)

    @property
    def shm(self) -> bool:
        return self.transport == SHM

    def client(self) -> MooncakeClient | None:
        """The connected client, or None while offline or while calls fail (only one call per retry_interval_s
        tries again: Health.may_try)."""
        store = self.store
        if store is None or self.health.may_try():
            return store
        return None

    @property
    def read_path(self) -> str:
        """"shm (...)", "zero-copy" or "copy (why)": how pages move between the store and the host pool."""
        if self.transport == SHM:
            refused = self.staging.refused
            return (f"copy (shm client; {refused})" if refused else
                    f"shm (mooncake_client {self.config.client_server_address} on this host, staged in shared memory)")
        return self.memory.path(self.store)

    def register_host_memory(self, buf: PageBuffer) -> None:
        """Pages are read into and written from ``buf`` (the host pool): registered with the client now, or once
        it connects."""
        self.memory.add(buf)
        store = self.store
        if store is not None and self.transport == TCP:  # a dummy client registers only its own shared memory
            self.memory.register(store)

    def close(self) -> bool:
        """Stop the thread and close the client (waiting 2 s at most); False when it was closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            store, self.store = self.store, None
        self._stop.set()
        if store is not None:  # unmounting from a dead master takes the client ~10 s: shutdown waits 2 s at most
            def close_after_probe() -> None:
                self._thread.join()  # a health probe in flight finishes (or fails) before the client goes away
                if not self.staging.wait_idle(STAGING_WAIT_S):  # the client frees the staging areas' memory
                    logger.warning("L3 Mooncake: a call still uses a shared-memory staging area; its client is left "
                                   "open")
                    return
                close_quietly(store)

            t = threading.Thread(target=close_after_probe, name="tierlm-mooncake-close", daemon=True)
            t.start()
            t.join(CLOSE_WAIT_S)
        return True

    # --- the connection's thread ---
    def _connect_loop(self) -> None:
        c, attempt = self.config, 0
        while not self._stop.is_set():
            attempt += 1
            t0 = time.monotonic()
            store: MooncakeClient | None = None
            transport, why = SHM, ""
            if self.shm_wanted is True:
                store, why = self._setup_shm()
                if store is None and c.master_server_address and why != self.shm_refused:
                    logger.warning("L3 Mooncake: the same-host shared-memory path is refused (%s); pages move over "
                                   "%s to master %s instead (start mooncake_client, then restart this server to use "
                                   "it)", why, c.protocol, c.master_server_address)
                self.shm_refused = why or None
            if store is None and c.master_server_address:
                store, why = self._setup_tcp()
                transport = TCP
            if store is not None:
                with self._lock:
                    if self.closed:
                        close_quietly(store)
                        return
                    self.store, self.transport = store, transport
                    self.health.connected()
                if transport == SHM:
                    self.staging.attach(store)
                else:  # after self.store is set, so a region register_host_memory adds meanwhile is registered by
                    self.memory.register(store)  # one of the two; calls made before this copy (read_path says so)
                self._connected.set()
                logger.info("L3 Mooncake store online: connected to %s in %.2f s (attempt %d); pages move %s",
                            f"mooncake_client {c.client_server_address} (same host)" if transport == SHM
                            else f"master {c.master_server_address}", time.monotonic() - t0, attempt,
                            self.read_path)
                watch(self, self.health, store, self._probe_key, self._stop)
                return
            self.health.offline(why, attempt)
            self._stop.wait(self.health.retry_interval_s)

    def _setup_shm(self) -> tuple[MooncakeClient | None, str]:
        """A dummy client of the mooncake_client on this host, or (None, why not)."""
        address = self.config.client_server_address
        reachable = port_open(address)
        if reachable is not True:
            return None, f"mooncake_client {address} unreachable ({reachable})"
        store = self._client_factory()
        try:
            rc: int | str = store.setup_dummy(self.staging.max_slots * self.staging.slot_pages * self.value_bytes,
                                              self.config.local_buffer_size, address)
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and friends
            rc = f"{type(e).__name__}: {e}"
        return (store, "") if rc == 0 else (None, f"mooncake_client {address} refused a dummy client "
                                                  f"(setup_dummy returned {rc})")

    def _setup_tcp(self) -> tuple[MooncakeClient | None, str]:
        """A client of the master (lending global_segment_size bytes), or (None, why not)."""
        c = self.config
        # A Mooncake client retries an unreachable master for ~90 s inside setup(), and may hold the GIL
        # meanwhile (seen with 0.3.13): setup() is only called once the master's port accepts connections.
        reachable = port_open(c.master_server_address)
        if reachable is not True:
            return None, f"Mooncake master {c.master_server_address} unreachable ({reachable})"
        store = self._client_factory()
        try:
            rc: int | str = store.setup(c.local_hostname, c.metadata_server, c.global_segment_size,
                                        c.local_buffer_size, c.protocol, c.device_name, c.master_server_address)
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and friends
            rc = f"{type(e).__name__}: {e}"
        return (store, "") if rc == 0 else (
            None, f"cannot connect to Mooncake master {c.master_server_address} (setup returned {rc})")

    def reattach(self, old: MooncakeClient, probe_key: str) -> MooncakeClient:
        """A dummy client never re-attaches to a mooncake_client that restarted: while the old one fails, a fresh
        one is tried, and takes over once its probe passes. The client to use from now on."""
        new, _ = self._setup_shm()
        rc = None if new is None else probe(self.health, new, probe_key, shm=True)
        if new is None or rc != 0:
            if new is not None:
                close_quietly(new)  # the real client answers but the store behind it does not: keep waiting
            return old
        with self._lock:
            if self.closed:
                close_quietly(new)
                return old
            self.store = new
        self.staging.attach(new)
        self.health.ok()
        logger.info("L3 Mooncake: attached again to mooncake_client %s (it restarted)",
                    self.config.client_server_address)

        def retire() -> None:  # a call may still hold one of its staging areas
            if self.staging.wait_idle(STAGING_WAIT_S, old):
                close_quietly(old)

        threading.Thread(target=retire, name="tierlm-mooncake-retire", daemon=True).start()
        return new


def port_open(address: str, timeout: float = 1.0) -> bool | str:
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


def close_quietly(store: MooncakeClient) -> None:
    try:
        store.close()
    except Exception as e:  # noqa: BLE001
        logger.debug("closing the Mooncake client: %s", e)
