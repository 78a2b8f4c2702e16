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

#: the share of the cores' time other processes may take during the rounds before the tuner
#: refuses to store what it timed (0.25 on 2 cores: half a core busy elsewhere on average)
MAX_OTHERS_SHARE = 0.25


def _cpu_busy() -> float | None:
    """Seconds of CPU time all cores spent busy since boot (``/proc/stat``), None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    busy = sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)
    return busy / float(os.sysconf("SC_CLK_TCK"))


def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
        own = _own() - self.own
        busy = _cpu_busy()
        share = None
        if busy is not None and self.busy is not None and wall > 0:
            # /proc/stat counts every core of the machine; the process may be pinned to fewer
            total = os.cpu_count() or cpus
            share = max(0.0, (busy - self.busy - own) / (wall * total))
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
