"""Liveness-based memory plan for the intermediates of a compiled graph (DESIGN §9).

Steps run in order; an intermediate lives from the step that writes it to the last step that
reads it.  Intermediates are packed into one arena by greedy best-fit over lifetimes (largest
first), so buffers whose lifetimes do not overlap share memory.  Graph inputs are the caller's
arrays; graph outputs are handed out per call (they escape to the user); an output array the
caller has already dropped is reused by the next call instead of allocating (and page-faulting)
a new one.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

ALIGN = 64  # bytes: a cache line, and enough for 512-bit vector loads


@dataclass(frozen=True)
class Slot:
    """One intermediate: byte offset in the arena, size, and live range [first, last] step."""

    value: str
    offset: int
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryPlan:
    """Arena layout: ``slots`` by value name, ``arena_bytes`` total, ``naive_bytes`` without reuse."""

    slots: Mapping[str, Slot]
    arena_bytes: int
    naive_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.arena_bytes


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(steps: Sequence[tuple[Sequence[str], Sequence[str]]], nbytes: Mapping[str, int],
                external: set[str], members: Mapping[str, tuple[str, int]] | None = None) -> MemoryPlan:
    """Pack the intermediates of ``steps`` (a list of (inputs, outputs) value names).

    ``nbytes`` gives each value's size; values in ``external`` (graph inputs, outputs and
    constants) are not placed in the arena.  ``members`` (value -> (container, byte offset))
    places a value inside another's slot (a concat input in its slice of the concat output,
    runtime/concat.py): the container then lives from the first write of any member to the
    last read of any, and the member's slot is that sub-range.
    """
    members = members or {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, (ins, outs) in enumerate(steps):
        for v in outs:
            v = members[v][0] if v in members else v
            if v not in external:
                first.setdefault(v, k)
                last.setdefault(v, k)
        for v in ins:
            v = members[v][0] if v in members else v
            if v in first:
                last[v] = k
    order = sorted(first, key=lambda v: (-nbytes[v], first[v], v))
    placed: list[Slot] = []
    for v in order:
        size = _align(max(nbytes[v], 1))
        lo, hi = first[v], last[v]
        busy = sorted((s.offset, s.offset + _align(max(s.nbytes, 1))) for s in placed
                      if not (s.last < lo or s.first > hi))
        best, best_gap, cursor = None, None, 0
        for a, b in busy:
            gap = a - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, b)
        offset = best if best is not None else cursor
        placed.append(Slot(v, offset, nbytes[v], lo, hi))
    arena = max((s.offset + _align(max(s.nbytes, 1)) for s in placed), default=0)
    naive = sum(_align(max(nbytes[v], 1)) for v in first)
    by_value = {s.value: s for s in placed}
    for v, (c, off) in members.items():
        s = by_value.get(c)
        if s is not None:
            placed.append(Slot(v, s.offset + off, nbytes[v], s.first, s.last))
    return MemoryPlan({s.value: s for s in placed}, arena, naive)


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array starting on an ALIGN-byte boundary (a view of its
    own uint8 block; np.empty gives 16-byte alignment, and a 64-byte vector store to an
    unaligned row splits across two cache lines: softmax [768,128,128] out 4.3 -> 3.9 ms)."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    block = np.empty(n + ALIGN, np.uint8)
    off = (-block.ctypes.data) % ALIGN
    return block[off:off + n].view(dtype).reshape(shape)


class Arena:
    """One pre-faulted block holding every intermediate of a plan; views are made once."""

    def __init__(self, plan: MemoryPlan, types: Mapping, errors: tuple = ()):
        self.block = np.zeros(max(plan.arena_bytes, ALIGN) + ALIGN, dtype=np.uint8)
        base = (-self.block.ctypes.data) % ALIGN
        self.views: dict[str, np.ndarray] = {}
        for v, s in plan.slots.items():
            t = types[v]
            raw = self.block[base + s.offset: base + s.offset + s.nbytes]
            self.views[v] = raw.view(t.np_dtype).reshape(t.shape)
        # one int64 error word per named kernel that can find bad input (a gather's index out
        # of range): the kernel sets it, the executable checks them after the call
        self.errors = np.zeros(len(errors), np.int64) if errors else None
        self.errors_clear = bytes(8 * len(errors))     # errors.tobytes() when no word is set
        for k, v in enumerate(errors):
            self.views[v] = self.errors[k:k + 1]
        self._kept: dict[str, np.ndarray] = {}
        self.driver = None      # runtime/drive.py's DriverTables for this arena, made on first use

    def output_buffer(self, value: str, shape, dtype) -> np.ndarray:
        """A C-contiguous array for graph output ``value``: the array this arena handed out
        for it last time if nothing else references it any more (already faulted in, so a
        large output costs no page faults), else a new :func:`aligned_empty` array."""
        a = self._kept.pop(value, None)
        # references: this frame's ``a`` and getrefcount's argument -- nobody else holds it;
        # the caller's views of ``a`` reference its owner block instead, which then has more.
        # Every Python-level holder counts (memoryview, np.from_dlpack, ctypes.data_as, an
        # __array_interface__ object that keeps ``a``: tests/runtime/test_output_alignment.py);
        # only a bare integer address outlives the array unseen, as with any freed array
        if a is not None and sys.getrefcount(a) == 2 and a.shape == tuple(shape) \
                and a.dtype == dtype and a.flags.writeable and isinstance(a.base, np.ndarray) \
                and a.base.base is None and sys.getrefcount(a.base) == 2:
            return a
        return aligned_empty(shape, dtype)

    def keep_outputs(self, arrays: Mapping[str, np.ndarray], merge: bool = False) -> None:
        """Remember the fresh output arrays handed to the caller, for :meth:`output_buffer`.

        ``merge`` keeps what was remembered for the other outputs (a call whose ``out=`` gave
        some outputs did not use, and must not forget, the arrays kept for them)."""
        if merge:
            self._kept.update(arrays)
        else:
            self._kept = dict(arrays)


class ArenaPool:
    """Arenas for concurrent calls: each call borrows one (created on demand) and returns it."""

    def __init__(self, plan: MemoryPlan, types: Mapping, errors: tuple = ()):
        self._plan, self._types, self._errors = plan, types, tuple(errors)
        self._free: list[Arena] = []

    def acquire(self) -> Arena:
        # list.pop and list.append are atomic under the GIL: no lock needed (saves ~0.3 us a call)
        try:
            return self._free.pop()
        except IndexError:
            return Arena(self._plan, self._types, self._errors)

    def release(self, arena: Arena) -> None:
        self._free.append(arena)
