"""The Mooncake store's configuration, read as SGLang's mooncake_store backend reads it, first match wins:
  1. --hicache-storage-backend-extra-config with ``master_server_address`` (and the other keys below);
  2. the JSON file named by $SGLANG_HICACHE_MOONCAKE_CONFIG_PATH;
  3. the environment: MOONCAKE_MASTER (required there), MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_PROTOCOL,
     MOONCAKE_DEVICE, MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_LOCAL_HOSTNAME
     (or LOCAL_HOSTNAME).
Keys and SGLang's defaults: local_hostname "localhost", metadata_server "P2PHANDSHAKE" (or an http:// metadata
URL), global_segment_size 4 GiB (an int of bytes or "<n>gb": the memory this server lends to the store; 0
lends none), local_buffer_size 16 MiB, protocol "tcp" ("rdma" with device_name), master_server_address
"host:port" of ``mooncake_master``; client_server_address ("host:port" of a ``mooncake_client`` on this host,
$MOONCAKE_CLIENT) and standalone_storage choose the same-host path (shm.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Mapping

from tierlm.runtime.cache.storage.stores.mooncake.shm import same_host
from tierlm.runtime.errors import StartupError

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 * 1024**3  # SGLang's defaults
DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024**2
DEFAULT_LOCAL_HOSTNAME = "localhost"
DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_PROTOCOL = "tcp"
DEFAULT_DEVICE_NAME = ""
DEFAULT_CONNECT_WAIT_S = 5.0
DEFAULT_RETRY_INTERVAL_S = 5.0
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


def parse_size(value: object, name: str) -> int:
    """Bytes from an int or SGLang's "<n>gb" string (GiB)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            s = value.strip().lower()
            n = int(s[:-2].strip()) * 1024**3 if s.endswith("gb") else int(s)
        elif isinstance(value, (int, float)):
            n = int(value)
        else:
            raise TypeError
    except (TypeError, ValueError):
        raise StartupError(f"mooncake {name} must be a number of bytes or \"<n>gb\", got {value!r}") from None
    if n < 0:
        raise StartupError(f"mooncake {name} must be >= 0 bytes, got {value!r}")
    return n


def parse_flag(value: object, name: str) -> bool | None:
    """None (unset), or a bool from a JSON bool or "true"/"false"/"1"/"0" (an environment variable)."""
    if value is None or isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise StartupError(f"mooncake {name} must be true or false, got {value!r}")


def parse_seconds(value: object) -> float:
    """float(value) for a number or a numeric string; TypeError / ValueError (float()'s own) otherwise."""
    if isinstance(value, (int, float, str)):
        return float(value)
    raise TypeError(f"float() argument must be a string or a real number, not '{type(value).__name__}'")


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
    def from_mapping(cls, cfg: Mapping[str, object], source: str) -> MooncakeConfig:
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
    def resolve(cls, extra_config: Mapping[str, object] | None = None,
                env: Mapping[str, str] | None = None) -> MooncakeConfig:
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
        from_env = {key: env[var] for key, var in _ENV.items() if env.get(var)}
        if "local_hostname" not in from_env and env.get("LOCAL_HOSTNAME"):
            from_env["local_hostname"] = env["LOCAL_HOSTNAME"]
        return cls.from_mapping(from_env, "MOONCAKE_* environment variables")

    def describe(self) -> str:
        d = asdict(self)
        return ", ".join(f"{k}={d[k]!r}" for k in CONFIG_KEYS)

    def shm_wanted(self) -> bool | str:
        """True when pages should move through a mooncake_client on this host (shm.py), else why not."""
        if not self.client_server_address:
            return "no client_server_address (a mooncake_client on this host)"
        if self.standalone_storage is False:
            return "standalone_storage is false"
        local = same_host(self.client_server_address)
        return True if local is True else f"mooncake_client {self.client_server_address} is not on this host ({local})"
