"""Progress lines for long compiles.

A compile that runs longer than ``after_s`` seconds starts writing one line per stage update to
stderr (``apollo_py: compiling bert: layer 1 fusion 120/300 micro-graphs, 4.2 s``), at most every
``every_s`` seconds, and a final line with the total time.  Short compiles print nothing.
``Options.progress``: True always reports (after ``after_s``), False never, None (default) only
when stderr is a terminal.
"""
from __future__ import annotations

import sys
import time

AFTER_S = 2.0    # a compile is "long" once it has run this many seconds
EVERY_S = 0.5    # at most one line per this many seconds


class Progress:
    """Counts work items per stage; silent until the compile has run ``after_s`` seconds."""

    def __init__(self, what: str, enabled: bool | None = None, *, after_s: float | None = None,
                 every_s: float | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.what = what
        self.after_s = AFTER_S if after_s is None else after_s
        self.every_s = EVERY_S if every_s is None else every_s
        self.t0 = time.perf_counter()
        self._last = -1.0
        self._shown = False
        self.stage_name, self.total, self.count = "", 0, 0

    def stage(self, name: str, total: int) -> None:
        """Start stage ``name`` with ``total`` work items."""
        self.stage_name, self.total, self.count = name, total, 0
        self._maybe_print()

    def step(self, n: int = 1) -> None:
        """``n`` more items of the current stage are done."""
        self.count += n
        self._maybe_print()

    def done(self) -> None:
        """Final line with the total time (only if a progress line was shown)."""
        if self._shown:
            self._write(f"apollo_py: compiled {self.what} in {time.perf_counter() - self.t0:.1f} s")

    def _maybe_print(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter() - self.t0
        if now < self.after_s or now - self._last < self.every_s:
            return
        self._last = now
        self._shown = True
        self._write(f"apollo_py: compiling {self.what}: {self.stage_name} {self.count}/{self.total}, {now:.1f} s")

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):   # closed or broken stream: progress is best effort
            self.enabled = False
