"""The Mooncake Store client as tierlm uses it: the methods of ``mooncake.store.MooncakeDistributedStore`` that the
mooncake store calls, with the types its bindings declare. Nothing else of the client is reached, so a test double
(or another client with the same calls) only has to provide these.

Result codes are Mooncake's: 0 (or a byte count for reads into buffers) on success, a negative error code
otherwise (-704 OBJECT_NOT_FOUND, -900 RPC_FAIL, ...). Buffers are passed as addresses (``int``) of memory the
client registered (``register_buffer``), or, for a dummy client, allocated from its shared pool
(``alloc_from_mem_pool``).
"""
from __future__ import annotations

from typing import Callable, Protocol

# A page as the client takes it: one buffer per part (header, then the payload's rows), written in order.
Part = bytes | bytearray | memoryview


class MooncakeClient(Protocol):
    """The calls tierlm makes on a Mooncake Store client (positional arguments only, as tierlm passes them)."""

    # --- connecting ---
    def setup(self, local_hostname: str, metadata_server: str, global_segment_size: int, local_buffer_size: int,
              protocol: str, device_name: str, master_server_address: str, /) -> int:
        """A client of the master lending ``global_segment_size`` bytes; 0 when connected."""
        ...

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str, /) -> int:
        """A dummy client of the mooncake_client at ``server_address`` (same host, shared memory); 0 when attached."""
        ...

    def close(self) -> int:
        ...

    # --- memory the client reads into and writes from ---
    def register_buffer(self, buffer_ptr: int, size: int, /) -> int:
        ...

    def alloc_from_mem_pool(self, size: int, /) -> int:
        """The address of ``size`` bytes of a dummy client's shared memory (0: none left)."""
        ...

    # --- metadata ---
    def is_exist(self, key: str, /) -> int:
        """1 when stored, 0 when not, negative on an error."""
        ...

    def batch_is_exist(self, keys: list[str], /) -> list[int]:
        ...

    # --- reads ---
    def get(self, key: str, /) -> bytes:
        """The value, or b"" when absent (or when the call failed)."""
        ...

    def get_batch(self, keys: list[str], /) -> list[bytes]:
        ...

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], /) -> list[int]:
        """Each value spread over its buffers; per key the bytes read, or a negative code."""
        ...

    # --- writes ---
    def put_parts(self, key: str, /, *parts: Part) -> int:
        ...

    def put_from(self, key: str, buffer_ptr: int, size: int, /) -> int:
        ...

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]], /) -> list[int]:
        ...

    def upsert(self, key: str, value: bytes, /) -> int:
        ...

    def remove(self, key: str, force: bool, /) -> int:
        ...

    def remove_by_regex(self, regex_pattern: str, force: bool, /) -> int:
        ...


# What creates a client (mooncake.store.MooncakeDistributedStore, or a test's subclass of it).
ClientFactory = Callable[[], MooncakeClient]
