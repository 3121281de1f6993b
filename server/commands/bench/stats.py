"""Small statistics for benchmark tables: ratios, medians, nearest-rank percentiles."""
from __future__ import annotations

from typing import Sequence


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median(xs: Sequence[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = max(0, min(len(xs) - 1, -(-len(xs) * q // 100) - 1))
    return xs[int(k)]
