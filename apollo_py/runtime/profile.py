"""Profiling a compiled CPU executable: per-step times against the machine's roofline.

:func:`profile_executable` runs the executable ``repeat`` times with its ``trace`` hook on
(runtime/cpu.py records ``(schedule index, seconds)`` per dispatch) and reports, per dispatch
(one step, or several independent kernels layer 3 runs as one thread-pool job), the median
time, the bytes and flops the plan says it moves and computes, the achieved GB/s and GFLOP/s,
and its roofline position against the machine figures the cost model uses
(``executable.machine``, from :func:`apollo_py.machine.resolve_machine`): which roof bounds it
(``bytes/bandwidth`` vs ``flops/peak``) and what fraction of that bound the step reaches.

Bytes: a generated kernel's ``FusedKernel.bytes`` (its parameters' sizes), else the sizes of
the step's inputs and outputs.  Flops: the kernel's estimate, ``2·m·n·k`` (times the batch)
for a GEMM or BLAS call, the primitives' counts for a numpy step (:func:`_nodes_flops`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Mapping

from ..errors import ApolloError


@dataclass(frozen=True)
class StepProfile:
    """One dispatch: ``index`` in the run order, ``what`` it runs, median ``seconds``,
    ``bytes``/``flops`` from the plan, achieved ``gbps``/``gflops``, ``intensity``
    (flop/byte), ``bound`` ("memory" or "compute" on the machine's roofline), ``roof``: the
    fraction of the bound's rate reached (1.0 = at the roof), ``share`` of the total time,
    ``steps``: which of the executable's steps (the plan's ``kernels``) the dispatch ran."""

    index: int
    what: str
    seconds: float
    bytes: int
    flops: int
    gbps: float
    gflops: float
    intensity: float
    bound: str
    roof: float
    share: float
    steps: tuple = ()           # indices into the executable's steps (= plan.kernels) it ran


@dataclass(frozen=True)
class Profile:
    """Per-dispatch profile of one executable on one set of inputs."""

    steps: tuple[StepProfile, ...]
    total_seconds: float        # median wall time of a whole run
    repeat: int
    bandwidth: float            # machine figures used (bytes/s, flop/s)
    peak: float
    machine_source: str

    def to_dict(self) -> dict:
        return {"total_seconds": self.total_seconds, "repeat": self.repeat, "bandwidth": self.bandwidth,
                "peak": self.peak, "machine_source": self.machine_source,
                "steps": [asdict(s) for s in self.steps]}

    def __str__(self) -> str:
        lines = [f"profile: {self.total_seconds * 1e3:.3f} ms per run (median of {self.repeat}); machine "
                 f"{self.bandwidth / 1e9:.1f} GB/s, {self.peak / 1e9:.1f} GFLOP/s ({self.machine_source})",
                 f"  {'#':>3} {'ms':>9} {'share':>6} {'GB/s':>8} {'GFLOP/s':>8} {'flop/B':>7} "
                 f"{'bound':<8} {'roof':>5}  step"]
        for s in self.steps:
            lines.append(f"  {s.index:>3} {s.seconds * 1e3:9.4f} {s.share:6.1%} {s.gbps:8.2f} {s.gflops:8.2f} "
                         f"{s.intensity:7.2f} {s.bound:<8} {s.roof:5.0%}  {s.what}")
        return "\n".join(lines)


def _step_cost(step, types) -> tuple[int, int, str]:
    """(bytes, flops, description) of one runtime step."""
    io = tuple(dict.fromkeys((*step.inputs, *step.outputs)))
    nbytes = sum(types[v].nbytes for v in io if v in types)
    fused = getattr(step, "fused", None)
    if fused is not None:
        return int(fused.bytes), int(fused.flops), f"kernel {fused.name}: {' '.join(n.op for n in fused.nodes)}"
    desc = getattr(step, "desc", None)
    if desc is not None and hasattr(desc, "formula"):                 # BLAS call
        return nbytes, int(desc.flops), f"blas {desc.formula()}"
    compiled = getattr(step, "compiled", None)
    d = getattr(compiled, "desc", None)
    if d is not None and hasattr(d, "dk"):                             # fused attention
        return nbytes, int(d.flops), f"attention {d.name}"
    if d is not None and hasattr(d, "m"):                              # generated GEMM
        return nbytes, int(2 * d.batch * d.m * d.n * d.k), f"gemm {d.name}"
    copies = getattr(step, "copies", None)
    if copies is not None:      # runtime/concat.py: producers wrote their slices, the rest is copied
        moved = 2 * sum(types[v].nbytes for v, _, _ in copies)
        return moved, 0, f"concat in place ({len(copies)} input(s) copied)"
    if getattr(step, "noop", False):    # runtime/concat.py: a slice placed inside its input
        return 0, 0, "view " + " ".join(n.op for n in step.nodes)
    nodes = getattr(step, "nodes", ())
    if nodes and all(n.op == "reshape" for n in nodes):     # a view of its input: moves nothing
        nbytes = 0
    return nbytes, _nodes_flops(nodes, types), "numpy " + " ".join(n.op for n in nodes)


def _nodes_flops(nodes, types) -> int:
    """Flops of primitives run through numpy: ``2·out·K`` for a matmul, the input size for a
    reduction, the output size otherwise (a reshape or a constant counts as none)."""
    total = 0
    for n in nodes:
        if n.op in ("reshape", "constant") or not n.outputs or n.outputs[0] not in types:
            continue
        out = types[n.outputs[0]]
        if n.op == "matmul" and n.inputs and n.inputs[0] in types and types[n.inputs[0]].shape:
            total += 2 * out.size * types[n.inputs[0]].shape[-1]
        elif n.op.startswith("reduce_") and n.inputs and n.inputs[0] in types:
            total += types[n.inputs[0]].size
        else:
            total += out.size
    return int(total)


def profile_executable(exe, feeds: Mapping, repeat: int = 10, warmup: int = 1) -> Profile:
    """Profile ``exe`` (a CpuExecutable) on ``feeds`` (bound input arrays); see the module docs.

    The trace hook is per executable: runs of the same executable from other threads while
    this profiles would be counted too (the caller profiles on a quiet executable).
    """
    if not hasattr(exe, "trace") or not hasattr(exe, "_schedule"):
        raise ApolloError("profile needs target='cpu' with one static schedule (this executable "
                          f"is a {type(exe).__name__})")
    if repeat < 1:
        raise ApolloError(f"profile: repeat must be >= 1, got {repeat}")
    for _ in range(max(0, warmup)):
        exe.run(feeds)
    per: dict[int, list[float]] = {}
    totals = []
    trace: list = []
    exe.trace = trace
    try:
        for _ in range(repeat):
            del trace[:]
            t0 = time.perf_counter()
            exe.run(feeds)
            totals.append(time.perf_counter() - t0)
            for k, sec in trace:
                per.setdefault(k, []).append(sec)
    finally:
        exe.trace = None
    m = exe.machine
    types = exe.graph.types
    total = statistics.median(totals)
    where = {id(s): i for i, s in enumerate(exe.steps)}
    steps = []
    for k, (kind, item) in enumerate(exe._schedule):
        members = item if kind == "kernels" else [item]
        costs = [_step_cost(s, types) for s in members]
        nbytes, flops = sum(c[0] for c in costs), sum(c[1] for c in costs)
        what = " | ".join(c[2] for c in costs)
        sec = statistics.median(per.get(k, [0.0]))
        t_mem, t_comp = nbytes / m.bandwidth, flops / m.peak
        bound = "compute" if t_comp > t_mem else "memory"
        roof = (max(t_mem, t_comp) / sec) if sec > 0 else 0.0
        steps.append(StepProfile(
            index=k, what=what, seconds=sec, bytes=nbytes, flops=flops,
            gbps=nbytes / sec / 1e9 if sec > 0 else 0.0, gflops=flops / sec / 1e9 if sec > 0 else 0.0,
            intensity=flops / nbytes if nbytes else 0.0, bound=bound, roof=roof,
            share=sec / total if total > 0 else 0.0, steps=tuple(where[id(s)] for s in members)))
    return Profile(tuple(steps), total, repeat, m.bandwidth, m.peak, m.source)
