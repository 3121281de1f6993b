"""A model's fingerprint: a cheap sha256 of its config and sampled weight bytes, used to namespace L3 pages."""
from __future__ import annotations

import hashlib
from pathlib import Path

from tierlm.backends.model_source.model_folder import ModelFolder, as_model_folder

FINGERPRINT_EDGE_BYTES = 1 << 20  # hashed at each end of every weight file
FINGERPRINT_MIDDLE_SAMPLES = 8  # evenly spaced blocks hashed between the two ends
FINGERPRINT_SAMPLE_BYTES = 64 << 10


def model_fingerprint(model_dir: ModelFolder | Path) -> str:
    """A sha256 hex digest that identifies the model's config and weights, cheap even for huge models.

    Hashed: a format tag, the bytes of config.json, then for each weight file (*.safetensors, *.bin in the
    folder, sorted by name) its name, its size and a content sample: the first and last 1 MiB plus 8 evenly
    spaced 64 KiB blocks (the whole file when it is small). So a copied folder keeps its fingerprint (no
    paths, mtimes or inodes are hashed), while new weights change it: a safetensors file starts with its
    tensor header, and retrained or re-quantised weights differ throughout. A change confined to unsampled
    bytes of a big file is not detected; that is the price of not reading gigabytes at every start.
    """
    folder = as_model_folder(model_dir)
    digest = hashlib.sha256(b"tierlm-model-fingerprint-v1\0")
    digest.update(folder.config_bytes if folder.config_bytes is not None else b"<no config.json>")
    for weight in folder.weight_files:
        size = weight.stat().st_size
        digest.update(f"\0{weight.name}\0{size}\0".encode())
        with weight.open("rb") as f:
            for offset, length in _sample_ranges(size):
                f.seek(offset)
                digest.update(f.read(length))
    return digest.hexdigest()


def _sample_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) pairs of a file of ``size`` bytes to hash: all of it if small, else ends + samples."""
    if size <= 2 * FINGERPRINT_EDGE_BYTES + FINGERPRINT_MIDDLE_SAMPLES * FINGERPRINT_SAMPLE_BYTES:
        return [(0, size)]
    ranges = [(0, FINGERPRINT_EDGE_BYTES)]
    span = size - 2 * FINGERPRINT_EDGE_BYTES - FINGERPRINT_SAMPLE_BYTES
    for i in range(1, FINGERPRINT_MIDDLE_SAMPLES + 1):
        ranges.append((FINGERPRINT_EDGE_BYTES + span * i // (FINGERPRINT_MIDDLE_SAMPLES + 1),
                       FINGERPRINT_SAMPLE_BYTES))
    ranges.append((size - FINGERPRINT_EDGE_BYTES, FINGERPRINT_EDGE_BYTES))
    return ranges
