"""The namespace of an L3 cache: everything that decides what the bytes of a stored KV page mean.

Two servers may share one storage folder only when their pages are byte-compatible; the namespace id is a
SHA-256 over a canonical JSON of those facts, and every stored page lives under (and names in its header) the
id of the namespace that wrote it. A different model, dtype, page size, byte layout or KV shape gives a
different id, so it never hits. Bump ``CACHE_FORMAT_VERSION`` when the meaning of stored bytes changes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

# Version of what tierlm stores for a page (payload meaning + key scheme). Part of every namespace id.
CACHE_FORMAT_VERSION = 2  # 2: page files carry an XXH3-128 checksum (file format 2)

# Facts a namespace must state. "model" is the model fingerprint (ModelInfo.fingerprint); "layout" is the byte
# order of a stored page payload; "backend_layout" is ModelBackend.kv_byte_layout(). Extra fields are allowed
# and also separate namespaces.
REQUIRED_FIELDS = (
    "model", "dtype", "page_size", "layout", "num_layers", "num_kv_heads", "head_dim", "backend_layout",
)
ID_PREFIX_LEN = 16  # folder name length: 64 bits of the id, the full id is checked from namespace.json


@dataclass(frozen=True)
class StorageNamespace:
    fields: Mapping[str, Any]
    id: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", dict(self.fields))
        object.__setattr__(self, "id", hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest())

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> "StorageNamespace":
        """Validate the facts and build the namespace; ``fields`` is e.g. backend.kv_namespace() | page_size, layout."""
        if not isinstance(fields, Mapping):
            raise TypeError(f"namespace fields must be a dict, got {type(fields).__name__}")
        missing = [k for k in REQUIRED_FIELDS if k not in fields]
        if missing:
            raise ValueError(f"storage namespace is missing {missing}; pass all of {list(REQUIRED_FIELDS)}")
        for k, v in fields.items():
            if not isinstance(k, str):
                raise TypeError(f"namespace field names must be strings, got {k!r}")
            if k == "cache_format_version":
                raise ValueError("cache_format_version is set by tierlm itself; do not pass it")
            if not isinstance(v, (str, int, float, bool)) or v == "":
                raise ValueError(f"namespace field {k!r} must be a non-empty string or a number, got {v!r}")
        page_size = fields["page_size"]
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"namespace page_size must be a positive int, got {fields['page_size']!r}")
        return cls(fields)

    def describe(self) -> dict[str, Any]:
        """What namespace.json holds: the id, the format version and every field."""
        return {"id": self.id, "cache_format_version": CACHE_FORMAT_VERSION, "fields": dict(self.fields)}

    def canonical_json(self) -> str:
        doc = dict(self.fields)
        doc["cache_format_version"] = CACHE_FORMAT_VERSION
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)

    @property
    def folder_name(self) -> str:
        return self.id[:ID_PREFIX_LEN]

    @property
    def id_bytes(self) -> bytes:
        return bytes.fromhex(self.id)
