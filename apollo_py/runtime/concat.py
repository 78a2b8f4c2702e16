"""A concat whose inputs are written straight into their slices of its output (no copy).

A ``concat`` over an axis with only unit dims before it (NCHW at batch 1 over channels: the
U-Net skip connections ``cat([up(x), skip], 1)``) lays each input out as one contiguous block
of the output.  When a kernel, a BLAS call or a generated GEMM writes an input into a buffer
the runtime binds, the memory plan can place that input *inside* the concat output's slot
(``plan_memory``'s ``members``): the producer then writes its slice, and the concat has
nothing left to copy for it.  Inputs from elsewhere (graph inputs, constants, numpy steps'
results, an input that appears twice, a slice that would not start on a 64-byte boundary)
are still copied, by :class:`ConcatStep`, into their slices of the same buffer.

The converse holds for a slice that is one contiguous block of its input (Swin's ``qkv[0]``):
:func:`slice_views` places the result inside the input's slot, and the step
(:class:`SliceView`) does nothing.

:func:`concat_members` and :func:`slice_views` find the placements; the executable
(runtime/cpu.py) replaces those reference steps and tells each generated GEMM which of its
outputs it writes into the arena (:attr:`GemmStep.bound <apollo_py.runtime.gemm_step.GemmStep>`)
instead of a fresh array.  docs/design/stitching.md has the measurements.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from .memory import ALIGN


@dataclass
class ConcatStep:
    """A concat into a runtime-bound output: copies ``copies`` (input name, start, stop along
    ``axis``) into their slices; the other inputs were written there by their producers."""

    nodes: tuple
    inputs: tuple
    outputs: tuple
    reason: str
    axis: int
    copies: tuple
    writes_buffers = True

    @property
    def noop(self) -> bool:
        """True when every input is written in place: the step does nothing at run time."""
        return not self.copies

    def execute(self, env: dict, pool) -> None:
        out = env[self.outputs[0]]
        for v, lo, hi in self.copies:
            idx = (slice(None),) * self.axis + (slice(lo, hi),)
            np.copyto(out[idx], env[v])


@dataclass
class SliceView:
    """A slice that is a contiguous block of its input (unit dims before the sliced axis, whole
    dims after it): the memory plan places the result inside the input's slot, so the step
    does nothing at run time (Swin's and ViT's ``qkv[0]``, ``qkv[1]``, ``qkv[2]``)."""

    nodes: tuple
    inputs: tuple
    outputs: tuple
    reason: str
    writes_buffers = True
    noop = True

    def execute(self, env: dict, pool) -> None:
        pass


def _single(step, op: str):
    """The ``op`` node of a reference step that is exactly one such node, else None."""
    nodes = [n for n in getattr(step, "nodes", ()) if n.op != "constant"]
    if hasattr(step, "execute") or getattr(step, "fused", None) is not None or len(nodes) != 1:
        return None
    n = nodes[0]
    if n.op != op or tuple(step.outputs) != tuple(n.outputs):
        return None
    return n


def slice_views(steps, graph, root: dict, writers: dict, external: set, members: dict) -> tuple[dict, list]:
    """``(views, indices)``: slice result -> ``(input buffer, byte offset)`` for every slice step
    whose result is one contiguous, 64-byte aligned block of a runtime-bound input buffer that
    is not itself placed in another (``members``), and the indices of those steps."""
    types = graph.types
    views, at = {}, []
    for k, s in enumerate(steps):
        n = _single(s, "slice")
        if n is None:
            continue
        v, u = n.outputs[0], n.inputs[0]
        r = root.get(u, u)
        if v in external or v in root or r not in writers or r in external or r in members or r in views:
            continue
        shape, out = tuple(types[u].shape), tuple(types[v].shape)
        a = n.attrs
        if out == shape or any(int(st) != 1 for st in a["steps"]) or types[v].size == 0:
            continue
        ax = next(i for i, (d, e) in enumerate(zip(shape, out)) if d != e)
        if prod(shape[:ax]) != 1 or out[ax + 1:] != shape[ax + 1:]:
            continue
        start = slice(a["starts"][ax], a["ends"][ax], 1).indices(shape[ax])[0]
        off = start * prod(shape[ax + 1:]) * np.dtype(types[v].np_dtype).itemsize
        if off % ALIGN:
            continue
        views[v] = (r, off)
        at.append(k)
    return views, at


def concat_members(steps, graph, root: dict, writers: dict, external: set) -> tuple[dict, dict]:
    """``(members, concats)`` for the steps of a CPU executable.

    ``members``: input value -> ``(concat output, byte offset)`` for every input the memory
    plan places inside its concat's output; ``concats``: step index -> ``(axis, copies)`` for
    every concat step that becomes a :class:`ConcatStep` (``copies`` as in that class).
    ``root`` maps reshape views to the value they view; ``writers`` maps every value a step
    writes into a runtime-bound buffer (kernels, BLAS calls, generated GEMMs) to that step;
    ``external`` holds graph inputs, outputs and constants (never placed).

    An input joins when the concat output is an intermediate whose dims before the axis are
    all 1, the input's buffer (its reshape root) is written by one of ``writers``, is not
    external, is read by the concat once, belongs to no other concat, is no concat output
    itself, and its slice starts on a 64-byte boundary.
    """
    types = graph.types
    members: dict = {}
    concats: dict = {}
    outs = {n.outputs[0] for n in (_single(s, "concat") for s in steps) if n is not None}
    for k, s in enumerate(steps):
        n = _single(s, "concat")
        if n is None:
            continue
        c = n.outputs[0]
        tc = types[c]
        axis = int(n.attrs["axis"])
        if c in external or c in root or prod(tc.shape[:axis]) != 1 or tc.size == 0:
            continue
        inner = prod(tc.shape[axis + 1:]) * np.dtype(tc.np_dtype).itemsize
        placed, copies, at = {}, [], 0
        for v in n.inputs:
            width = types[v].shape[axis]
            r = root.get(v, v)
            off = at * inner
            if (r in writers and r not in external and r not in outs and r not in members and r not in placed
                    and n.inputs.count(v) == 1 and off % ALIGN == 0 and types[r].nbytes == types[v].nbytes):
                placed[r] = (c, off)
            else:
                copies.append((v, at, at + width))
            at += width
        if placed:
            members.update(placed)
            concats[k] = (axis, tuple(copies))
    return members, concats


def concat_step(step, axis: int, copies: tuple, members: dict) -> ConcatStep:
    """The :class:`ConcatStep` replacing reference ``step``; its reason says what is in place."""
    c = step.outputs[0]
    inplace = [v for v, (cv, _) in members.items() if cv == c]
    why = (f"concat in place: {', '.join(inplace)} written into their slices by their producers"
           + (f"; copies {', '.join(v for v, _, _ in copies)}" if copies else " (nothing to copy)"))
    return ConcatStep(tuple(step.nodes), tuple(step.inputs), tuple(step.outputs), why, axis, tuple(copies))
