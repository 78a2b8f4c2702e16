"""How much of the machine's CPU time *other* processes take (Linux ``/proc/stat``).

The machine's busy time less this process's own (``os.times``: its threads and reaped
children) is what others ran.  Two users: the tuner refuses to store timings taken while others
were busy (``tuning/load.py``), and the native driver lends a call's parallel steps to a second
thread only while the cores are free (:class:`QuietGate`, ``runtime/drive.py``).  The load
average is no substitute: it lags by a minute and counts this process's own threads.
"""
from __future__ import annotations

import os
import time


def cpu_busy() -> float | None:
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


def own_cpu() -> float:
    """CPU seconds of this process: its threads and the children it has reaped."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def others_share(busy0: float | None, own0: float, busy: float | None, own: float,
                 wall: float) -> float | None:
    """Share of all cores' time that other processes ran between two readings of
    (:func:`cpu_busy`, :func:`own_cpu`), ``(busy0, own0)`` and ``(busy, own)``, taken ``wall``
    seconds apart; None where ``/proc/stat`` is not readable."""
    if busy is None or busy0 is None or wall <= 0:
        return None
    # /proc/stat counts every core of the machine; the process may be pinned to fewer
    total = os.cpu_count() or usable_cpus()
    return max(0.0, (busy - busy0 - (own - own0)) / (wall * total))


class QuietGate:
    """Whether two cores are free of other processes (the caller's and a helper's), re-judged
    every ``period`` seconds from the window since the last judgement: quiet while others ran
    at most ``cores - 2 + slack`` cores on average (on 2 cores: 0.4 of a core, 20% of the
    machine).  Quiet until the first window closes, and always where ``/proc/stat`` is
    missing.  A call costs one ``perf_counter`` between judgements; a judgement ~10 us."""

    def __init__(self, period: float = 0.25, slack: float = 0.4):
        cores = os.cpu_count() or 1
        self.period = period
        self.limit = max(0.0, cores - 2 + slack) / cores     # as a share of all cores' time
        self.quiet = True
        self._t = time.perf_counter()
        self._busy = cpu_busy()
        self._own = own_cpu()

    def __call__(self) -> bool:
        now = time.perf_counter()
        if now - self._t >= self.period:
            busy, own = cpu_busy(), own_cpu()
            share = others_share(self._busy, self._own, busy, own, now - self._t)
            self.quiet = share is None or share <= self.limit
            self._t, self._busy, self._own = now, busy, own
        return self.quiet
