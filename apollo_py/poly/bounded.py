"""Run an isl computation under a wall-time limit that really stops it (DESIGN §5).

isl's operations counter (``Context.set_max_operations``) does not bound the whole scheduler:
measured on real models, a GPT-2 export's masked-attention micro-graph stayed in
``compute_schedule()`` for over 15 minutes under a 200k budget.  isl holds the GIL, so a
watchdog thread cannot interrupt it; a forked child process can be killed.  :func:`run_bounded`
forks, runs ``fn`` in the child (which inherits the isl context and the objects ``fn`` closes
over, copy-on-write), and reads back the text ``fn`` returns (an isl object printed, which the
parent parses in its own context).  Past ``seconds`` the child is killed and
:class:`WallTimeExceeded` raised; an exception in the child comes back as
:class:`ChildError` with the exception's class name and message.

Where ``os.fork`` is missing (not POSIX) ``fn`` runs in-process, bounded by the operations
budget alone.  The child only runs isl and writes to a pipe, then leaves with ``os._exit`` (no
atexit handlers, no flushing of the parent's buffers, no thread-pool shutdown).
"""
from __future__ import annotations

import os
import select
import signal
import time
from typing import Callable


class WallTimeExceeded(Exception):
    """The computation ran past its wall-time limit and was stopped."""


class ChildError(Exception):
    """``fn`` raised in the child: ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def _child(fn: Callable[[], str], w: int) -> None:
    try:
        data = b"K" + fn().encode()
    except BaseException as e:          # noqa: BLE001 - everything goes back to the parent
        data = b"E" + f"{type(e).__name__}\n{e}".encode(errors="replace")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    finally:
        os._exit(0)


def run_bounded(fn: Callable[[], str], seconds: float | None) -> str:
    """``fn()`` (a str), computed in a child process killed after ``seconds`` (None or <= 0:
    in-process, unbounded).  Raises WallTimeExceeded or ChildError."""
    if not seconds or seconds <= 0 or not hasattr(os, "fork"):
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                        # the child
        os.close(r)
        _child(fn, w)
    os.close(w)
    chunks, deadline, done = [], time.monotonic() + seconds, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 1 << 20)
            if not chunk:
                done = True
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        if not done:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(pid, 0)
    if not done:
        raise WallTimeExceeded(f"stopped after {seconds:g} s")
    data = b"".join(chunks)
    if data[:1] == b"K":
        return data[1:].decode()
    kind, _, message = data[1:].decode(errors="replace").partition("\n")
    raise ChildError(kind or "unknown", message or "the child process ended without a result")
