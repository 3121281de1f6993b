"""The 128-byte header every stored L3 page carries, whatever the backend (a page file, a Mooncake object).

Layout (little-endian), then the raw payload, never pickle:
  0  magic b"TLMKV" | 5 format version u16 | 7 namespace id (32 raw bytes) | 39 key (32 raw bytes)
  71 payload length u64 | 79..95 zero | 96 XXH3-128 (big-endian digest) over header[0:96] + payload
  112..127 zero | 128 payload
The key (the SHA-256 chain of page_keys.py) is the page's identity; the XXH3-128 checksum only has to catch
damage, so it runs at memory speed (tens of GB/s) where SHA-256 ran at ~1 GB/s (format version 1).
A backend reads header + payload and calls ``verify``: any answer but None makes the entry a counted miss.
"""
from __future__ import annotations

import struct
from typing import Any, Sequence

import xxhash

MAGIC = b"TLMKV"
FORMAT_VERSION = 2  # 1: SHA-256 payload checksum; 2: XXH3-128
HEADER_SIZE = 128
FIELDS = struct.Struct("<5sH32s32sQ")  # magic, version, namespace id, key, payload length
CHECKSUM_OFFSET = 96
CHECKSUM_END = 112  # XXH3-128 digest, 16 bytes; the rest of the header is zero
ZERO_TAIL = bytes(HEADER_SIZE - CHECKSUM_END)


def checksum(header: bytes | memoryview, views: Sequence[Any]) -> bytes:
    """XXH3-128 over the first 96 header bytes and the payload: the payload's integrity check."""
    h = xxhash.xxh3_128(header)
    for view in views:
        h.update(view)
    return h.digest()


def pack_header(ns_raw: bytes, key: str, views: Sequence[memoryview]) -> bytes:
    """The header of page ``key`` (64 hex) of namespace ``ns_raw`` whose payload is ``views`` joined."""
    length = sum(v.nbytes for v in views)
    header = FIELDS.pack(MAGIC, FORMAT_VERSION, ns_raw, bytes.fromhex(key), length).ljust(CHECKSUM_OFFSET, b"\0")
    return header + checksum(header, views) + ZERO_TAIL


def verify(header: bytes | bytearray | memoryview, got: int, size: int, *, key: str, ns_raw: bytes,
           ns_label: str, page_bytes: int, views: Sequence[memoryview]) -> str | None:
    """Why the stored entry is unusable, or None when it is the intact page ``key`` of namespace ``ns_raw``.
    ``got`` bytes of the ``size``-byte entry were read into ``header`` (HEADER_SIZE bytes) and then ``views``."""
    if got < HEADER_SIZE:
        return f"truncated header ({got} of {HEADER_SIZE} bytes)"
    magic, version, entry_ns, key_raw, length = FIELDS.unpack_from(header)
    if magic != MAGIC:
        return "bad magic"
    if version != FORMAT_VERSION:
        return f"file format version {version}, this tierlm reads {FORMAT_VERSION}"
    if entry_ns != ns_raw:
        return f"written by namespace {entry_ns.hex()[:16]}, not {ns_label}"
    if key_raw.hex() != key:
        return f"holds page {key_raw.hex()[:12]}.. under the name of {key[:12]}.."
    if length != page_bytes:
        return f"payload length {length} in header, expected {page_bytes}"
    if got - HEADER_SIZE < length:
        return f"truncated payload ({got - HEADER_SIZE} of {length} bytes)"
    if size > HEADER_SIZE + length:
        return f"entry is longer than the {length}-byte payload its header states"
    if bytes(header[CHECKSUM_END:HEADER_SIZE]) != ZERO_TAIL:
        return "reserved header bytes are not zero"
    if checksum(memoryview(header)[:CHECKSUM_OFFSET], views) != bytes(header[CHECKSUM_OFFSET:CHECKSUM_END]):
        return "checksum mismatch"
    return None
