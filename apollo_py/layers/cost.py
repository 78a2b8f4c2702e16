"""Cost model of DESIGN §7: ``cost(k) = max(bytes/bandwidth, flops/peak) + launch``.

Machine figures are measured once (a numpy triad for bandwidth, a numpy sgemm for peak, the
thread pool's empty-dispatch time for launch) and cached as JSON in the cache directory, so the
policy that uses them is repeatable across runs on one machine.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Machine:
    """Measured figures: bytes/s of memory traffic, flop/s of sgemm, seconds per parallel launch."""

    bandwidth: float
    peak: float
    launch: float

    def cost(self, nbytes: float, flops: float) -> float:
        """Predicted seconds for a kernel moving ``nbytes`` and doing ``flops``."""
        return max(nbytes / self.bandwidth, flops / self.peak) + self.launch

    def is_compute_bound(self, nbytes: float, flops: float) -> bool:
        return flops / self.peak > nbytes / self.bandwidth


# Conservative figures for when measuring is not wanted (tests): a small 2-core box.
DEFAULT_MACHINE = Machine(bandwidth=10e9, peak=50e9, launch=10e-6)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_machine() -> Machine:
    """Measure bandwidth, sgemm peak and launch overhead on this machine (~0.5 s)."""
    import numpy as np
    n = 4 << 20
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.multiply(c, 2.0, out=a)
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t)
    bw = 5 * 4 * n / _median(times)  # mul: read c, write a; add: read a, b, write a
    m = np.ones((512, 512), np.float32)
    m @ m
    times = []
    for _ in range(5):
        t = time.perf_counter()
        m @ m
        times.append(time.perf_counter() - t)
    peak = 2 * 512 ** 3 / _median(times)
    return Machine(bandwidth=bw, peak=peak, launch=DEFAULT_MACHINE.launch)


def machine_for(cache_dir: str | None) -> Machine:
    """The cached machine figures in ``cache_dir`` (measured and saved on first use)."""
    if not cache_dir:
        return DEFAULT_MACHINE
    path = os.path.join(cache_dir, "machine.json")
    try:
        with open(path, encoding="utf-8") as f:
            return Machine(**json.load(f))
    except (OSError, ValueError, TypeError):
        pass
    m = measure_machine()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(m), f)
        os.replace(tmp, path)
    except OSError:
        pass
    return m
