"""When each request is sent: all at once, Poisson, or gamma arrivals (seeded).

Gaps between arrivals follow a gamma distribution with shape `burstiness` and mean
``1 / rate``. Burstiness 1 is a Poisson process (exponential gaps); below 1 requests
come in bursts, above 1 they come more evenly (as in vLLM's `--burstiness`).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `num_requests` requests is sent, in
    non-decreasing order; the first request is sent at 0. ``rate=inf`` sends all at 0."""
    if num_requests < 0:
        raise ValueError(f"number of requests must be >= 0, got {num_requests}")
    if not rate > 0:  # also refuses NaN
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
