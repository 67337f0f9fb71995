"""When each request is sent: offsets from the run's start for an open-loop arrival process.

Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as vLLM's
`--burstiness`: shape 1 is a Poisson process (exponential gaps, coefficient of variation 1);
the CV is 1/sqrt(burstiness), so below 1 arrivals come in bursts and large values approach a
metronome. The first request goes at offset 0. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `num` requests is due."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate} and {burstiness}")
    if math.isinf(rate) or num == 0:
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
