"""Summary statistics of latency samples: mean and percentiles, pure Python."""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) with linear interpolation between the closest
    ranks (NumPy's default, ``method="linear"``). NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """``{"count", "mean", "p50", "p90", "p99", "min", "max"}`` of `values` times `scale`
    (1000 turns seconds into milliseconds). Figures are None when there are no values,
    so that the JSON stays valid (no NaN)."""
    result: dict[str, float | int | None] = {"count": len(values)}
    if not values:
        result.update({"mean": None, **{f"p{q}": None for q in PERCENTILES}, "min": None, "max": None})
        return result
    scaled = [v * scale for v in values]
    result["mean"] = sum(scaled) / len(scaled)
    for q in PERCENTILES:
        result[f"p{q}"] = percentile(scaled, q)
    result["min"] = min(scaled)
    result["max"] = max(scaled)
    return result
