"""How busy the machine was while the tuner timed candidates (docs/design/tuning.md, "Load").

A decision follows the conditions it was timed under: at load 9-14 on the shared 2-core box
"one thread" won 12 of 12 GEMM pieces, at load 4 it was 1.4-1.8x slower on every one.  So the
tuner samples, over its rounds, how much CPU time *other* processes took: the machine's busy
time (``/proc/stat``) minus this process's own (``os.times``: its threads and reaped children,
e.g. the forked GEMM compiler), as a share of the cores' wall time.  The load average is
recorded next to it for people (it lags by a minute and counts this process's threads too, so
it does not decide anything).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..cpuload import cpu_busy, others_share, own_cpu, usable_cpus

#: the share of the cores' time other processes may take during the rounds before the tuner
#: refuses to store what it timed (0.25 on 2 cores: half a core busy elsewhere on average)
MAX_OTHERS_SHARE = 0.25


# the sampling itself lives below the layers (the runtime's driver uses it too)
_cpu_busy, _own = cpu_busy, own_cpu


def loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


@dataclass
class LoadWindow:
    """Started by :func:`start`; :meth:`stop` gives what other processes took meanwhile."""

    wall: float
    busy: float | None
    own: float
    load_start: float | None

    def stop(self) -> dict:
        """``{"others_share", "loadavg": [start, end], "cpus", "seconds"}``: ``others_share`` is
        the share of all usable cores' time that other processes were running (None where
        ``/proc/stat`` is not readable: then the 1-minute load average less this process's
        own use stands in for it)."""
        wall = time.perf_counter() - self.wall
        cpus = usable_cpus()
        own_now = _own()
        own = own_now - self.own
        share = others_share(self.busy, self.own, _cpu_busy(), own_now, wall)
        end = loadavg()
        if share is None and end is not None and wall > 0:
            share = max(0.0, end - own / wall) / cpus
        return {"others_share": None if share is None else round(share, 3),
                "loadavg": [self.load_start, end], "cpus": cpus, "seconds": round(wall, 2)}


def start() -> LoadWindow:
    return LoadWindow(time.perf_counter(), _cpu_busy(), _own(), loadavg())


def too_busy(evidence: dict, limit: float | None = None) -> str:
    """The refusal message when other processes took more than ``limit`` (default
    :data:`MAX_OTHERS_SHARE`) of the cores while the tuner timed, else ""."""
    limit = MAX_OTHERS_SHARE if limit is None else limit
    share = evidence.get("others_share")
    if share is None or share <= limit:
        return ""
    return (f"other processes used {share:.0%} of the {evidence['cpus']} cores' time while the tuner timed "
            f"(load average {evidence['loadavg'][0]} -> {evidence['loadavg'][1]}; at most {limit:.0%} allowed): "
            f"timings on a busy machine pick decisions for that load, so none were stored (the pieces keep "
            f"the compiler's defaults); tune again on a quiet machine, or pass allow_load=True "
            f"(apollo-py tune --allow-load) to store them anyway")
