"""The whole-compile deadline (``Options.compile_timeout``, issue #16).

A compile that enters :func:`compile_deadline` gets a :class:`Deadline` for the current
context (a ``contextvars.ContextVar``: every thread and every asyncio task has its own, so
compiles in different threads never see each other's deadline).  The long stages call
:func:`check` between units of work (one partition rule, one micro-graph group of layers 2
and 1, one layer-1 kernel, one LLVM piece, one layer-3 level); past the deadline it raises
:class:`~apollo_py.errors.CompileTimeoutError` naming the stage and the micro-graph or kernel
it was in.  The one unit that can run long by itself, the isl scheduler, runs in a child
process whose wall-time limit is capped by the time left (:func:`seconds_left`).

Checks sit *between* units, never inside a cache write, so a timeout leaves no half-written
cache entry (the piece cache also writes through ``fsutil.atomic_write``).  Expiry is sticky:
once the deadline has passed every later check raises, so an ``except ApolloError`` that
swallows one check (e.g. an If branch tried speculatively) cannot hide the timeout for long.

Nested compiles (a Loop body, a staged model's head) share the outermost deadline.
"""
from __future__ import annotations

import contextlib
import contextvars
import time

from .errors import CompileTimeoutError

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("apollo_py_compile_deadline", default=None)


class Deadline:
    """``seconds`` of wall time for the compile of ``what``, counted from creation."""

    def __init__(self, seconds: float, what: str = ""):
        self.seconds = float(seconds)
        self.what = what
        self.end = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, stage: str, where="") -> None:
        """CompileTimeoutError if the deadline has passed (``where``: the micro-graph/kernel,
        or a function that says it, called only then)."""
        if time.monotonic() > self.end:
            where = where() if callable(where) else where
            what = f" of {self.what!r}" if self.what else ""
            at = f", at {where}" if where else ""
            err = CompileTimeoutError(f"compile{what} ran past Options.compile_timeout = {self.seconds:g} s "
                                      f"in stage {stage!r}{at}")
            err.stage, err.where, err.seconds = stage, where, self.seconds
            raise err


@contextlib.contextmanager
def compile_deadline(options, what: str = ""):
    """Run the block under ``options.compile_timeout`` (None: no deadline).  Inside an
    enclosing compile's deadline the enclosing one stays in force (one deadline per compile)."""
    seconds = getattr(options, "compile_timeout", None)
    if seconds is None or _CURRENT.get() is not None:
        yield _CURRENT.get()
        return
    d = Deadline(seconds, what)
    token = _CURRENT.set(d)
    try:
        yield d
    finally:
        _CURRENT.reset(token)


def check(stage: str, where="") -> None:
    """Raise CompileTimeoutError if the current compile is past its deadline (no-op without
    one; costs one ContextVar read and one clock read)."""
    d = _CURRENT.get()
    if d is not None:
        d.check(stage, where)


def seconds_left() -> float | None:
    """Seconds left to the current compile's deadline (None: no deadline)."""
    d = _CURRENT.get()
    return None if d is None else d.left()
