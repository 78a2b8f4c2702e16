"""Progress bars for long compiles (tqdm).

A compile that runs longer than ``after_s`` seconds shows one bar per stage on stderr
(``apollo_py: compiling bert: layer 1 fusion  40%|████      | 120/300 [00:04<00:06]``), refreshed
at most every ``every_s`` seconds, and a final line with the total time.  Short compiles print
nothing.  ``Options.progress``: True always reports (after ``after_s``), False never, None
(default) only when stderr is a terminal.
"""
from __future__ import annotations

import sys
import time

AFTER_S = 2.0    # a compile is "long" once it has run this many seconds
EVERY_S = 0.5    # at most one refresh per this many seconds


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
        self._bar = None
        self.stage_name, self.total, self.count = "", 0, 0
        self._stage_t0 = self.t0
        self.timings: list[tuple[str, float]] = []    # (stage, seconds) of every finished stage

    def _finish_stage(self) -> None:
        now = time.perf_counter()
        if self.stage_name:
            self.timings.append((self.stage_name, now - self._stage_t0))
        self._stage_t0 = now

    def stage(self, name: str, total: int = 0) -> None:
        """Start stage ``name`` with ``total`` work items (the previous stage ends here)."""
        self._close()
        self._finish_stage()
        self.stage_name, self.total, self.count = name, total, 0
        if not self.enabled:
            return
        from tqdm import tqdm
        # tqdm's delay counts from the bar's creation; ours from the compile's start
        delay = max(0.0, self.after_s - (time.perf_counter() - self.t0))
        try:
            self._bar = tqdm(total=total, desc=f"apollo_py: compiling {self.what}: {name}", file=self.stream,
                             mininterval=self.every_s, delay=delay, leave=False, dynamic_ncols=True)
        except (OSError, ValueError):   # closed or broken stream: progress is best effort
            self.enabled = False

    def step(self, n: int = 1) -> None:
        """``n`` more items of the current stage are done."""
        self.count += n
        if self._bar is not None:
            try:
                self._bar.update(n)
            except (OSError, ValueError):
                self._bar, self.enabled = None, False

    def done(self) -> None:
        """Final line with the total time and each stage's share (only if the compile ran long
        enough to show bars)."""
        self._close()
        self._finish_stage()
        self.stage_name = ""
        elapsed = time.perf_counter() - self.t0
        if self.enabled and elapsed >= self.after_s:
            parts = ", ".join(f"{name} {t:.1f} s" for name, t in self.timings)
            try:
                self.stream.write(f"apollo_py: compiled {self.what} in {elapsed:.1f} s ({parts})\n")
                self.stream.flush()
            except (OSError, ValueError):
                self.enabled = False

    def _close(self) -> None:
        if self._bar is not None:
            try:
                self._bar.close()
            except (OSError, ValueError):
                self.enabled = False
            self._bar = None
