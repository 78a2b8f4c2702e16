"""Layer 1: polyhedral fusion and tiling of one micro-graph (DESIGN §5).

``fuse_micro_graph`` turns a micro-graph into one loop-IR kernel — or, when isl runs over the
operations budget or cannot give one fusion group, logs a feedback event and splits the
micro-graph (after its first inner reduction, else in two halves by topological order) and
fuses each part.  A single primitive is always fusable: if it alone exceeds the budget it is
scheduled again without one.

Pipeline per micro-graph: statements (``poly.statements``) -> dependences + one-group schedule
under the budget (``poly.schedule``) -> tiling of the outer band -> storage of intermediates
(``poly.storage``) -> isl AST -> loop IR (``poly.ast_to_loopir``).
"""
from __future__ import annotations

import hashlib
import time
from math import prod
from typing import Any, Mapping, Sequence

import islpy as isl

from ..codegen import loopir as L
from ..errors import CompileError
from ..ir.graph import Node
from ..ir.types import TensorType
from ..options import Options
from ..poly.ast_to_loopir import to_loop_ir
from ..poly.reduce_forms import micro_graph_reduce_form
from ..poly.schedule import BudgetExceeded, NotOneGroup, schedule_program, tile_outer_band
from ..poly.statements import build_program, compute_dependences
from ..poly.storage import StorageError, plan_storage
from .expand import expand_lower_rank


# defined in its own light module: a model-cache entry that pickles FusedKernels loads without
# importing layer 1 (islpy, the poly passes: ~0.1 s of a warm compile)
from .fused_kernel import FusedKernel  # noqa: E402

Kernel = FusedKernel   # the name the issue uses for layer 1's records


def signature_of(nodes: Sequence[Node], types: Mapping[str, TensorType]) -> str:
    """The micro-graph pattern signature (partition's, when that module is available)."""
    try:
        from ..ops.classify import classify
        from ..partition.signature import pattern_signature
        classes = [classify(n.op, tuple(types[v] for v in n.inputs),
                            tuple(types[v] for v in n.outputs), n.attrs) for n in nodes]
        return pattern_signature(list(nodes), classes)
    except ImportError:     # partition not importable yet: op names in order
        return "|".join(n.op for n in nodes)


def _boundary(nodes, outer_outputs, outside_reads):
    produced = {o for n in nodes for o in n.outputs}
    ins = list(dict.fromkeys(v for n in nodes for v in n.inputs if v not in produced))
    outs = [o for n in nodes for o in n.outputs if o in outer_outputs or o in outside_reads]
    return ins, outs


def split_nodes(nodes: Sequence[Node]) -> tuple[list, list]:
    """Where to split a micro-graph that cannot be fused: after its first reduction that is
    not the last node, else into two halves by topological order."""
    for k, n in enumerate(nodes[:-1]):
        if n.op.startswith("reduce_") or n.op == "window_reduce":
            return list(nodes[:k + 1]), list(nodes[k + 1:])
    h = len(nodes) // 2
    return list(nodes[:h]), list(nodes[h:])


def _estimate(nodes, types, params) -> tuple[int, int]:
    flops = 0
    for n in nodes:
        if n.op == "window_reduce":
            flops += types[n.outputs[0]].size * prod(n.attrs["kernel"])
        elif n.op.startswith("reduce_"):
            flops += types[n.inputs[0]].size
        else:
            flops += types[n.outputs[0]].size
    nbytes = sum(types[v].nbytes for v in params)
    return flops, nbytes


def _sizes(types, values) -> dict:
    return {v: list(types[v].shape) for v in values}


def log_refusal(options, event, sig, types, values, ms, detail):
    """Write feedback event ``event`` for pattern ``sig`` (sizes of ``values``); a log that
    cannot be written is ignored, since the log is advisory and must never fail a compile."""
    from ..feedback.log import log_event
    try:
        log_event(options, event, sig, sizes=_sizes(types, values), time_ms=ms, detail=detail)
    except OSError:      # the log is advisory: never fail a compile for it
        pass


def fuse_micro_graph(micro, types: Mapping[str, TensorType] | None = None,
                     inputs: Sequence[str] | None = None, outputs: Sequence[str] | None = None,
                     options: Options | None = None, *, name: str | None = None) -> list[FusedKernel]:
    """Fuse a micro-graph into loop-IR kernels (one unless a split was needed).

    ``micro`` is a MicroGraph (``.nodes``, ``.inputs``, ``.outputs``) or a list of Nodes in
    topological order (then ``inputs`` and ``outputs`` are required).  ``types`` gives every
    value's TensorType.  Single-element ``constant`` nodes are inlined; larger constants become
    kernel inputs.  Raises CompileError for an op without affine accesses (opaque ops are not
    layer 1's) or when even a single primitive cannot be scheduled.
    """
    options = options or Options()
    if types is None:
        raise CompileError("fuse_micro_graph needs the value types")
    mgs: tuple = ()
    if hasattr(micro, "nodes"):
        mgs = (micro,)
        nodes = list(micro.nodes)
        inputs = list(micro.inputs) if inputs is None else list(inputs)
        outputs = list(micro.outputs) if outputs is None else list(outputs)
    else:
        nodes = list(micro)
        if inputs is None or outputs is None:
            raise CompileError("fuse_micro_graph on a node list needs inputs and outputs")
        inputs, outputs = list(inputs), list(outputs)
    consts: dict[str, Any] = {}
    body = []
    for n in nodes:
        if n.op == "constant":
            arr = n.attrs["value"].array
            if arr.size == 1:
                consts[n.outputs[0]] = arr.reshape(()).item()
            else:
                inputs.append(n.outputs[0])
            continue
        body.append(n)
    if not body:
        return []
    base = name or "fused_" + hashlib.sha1(
        "|".join(f"{n.op}{n.inputs}{n.outputs}" for n in body).encode()).hexdigest()[:10]
    out: list[FusedKernel] = []
    _fuse(body, dict(types), list(dict.fromkeys(inputs + list(consts))), outputs, options, consts,
          mgs, base, out)
    return out


def _schedule_and_lower(nodes, types, inputs, outputs, options, consts, kname, budget_ops, seconds,
                        use_isl=True):
    """(FusedSchedule, loop-IR kernel, params, tiles) of ``nodes`` as one loop nest."""
    prog = build_program(nodes, types, inputs, outputs, isl.Context())   # one context per job
    fs, deps = schedule_program(prog, compute_dependences, budget_ops, seconds, use_isl=use_isl)
    tiles = tuple(options.tile_sizes or ())[:fs.band]
    sched = tile_outer_band(fs.schedule, fs.band, tiles)
    storage = plan_storage(prog, sched)
    params = [v for v in list(inputs) + list(outputs) if v not in consts]
    loop = to_loop_ir(prog, sched, storage, kname, parallel=fs.band > 0, consts=consts, param_order=params)
    return fs, loop, params, tiles


def _overlay_splits(options) -> frozenset:
    """``[[split]]`` signatures of ``options.rules_overlay`` (partition/rules.py)."""
    if not options.rules_overlay:
        return frozenset()
    from ..partition.rules import split_signatures
    return split_signatures(options.rules_overlay)


def _split(nodes, types, inputs, outputs, options, consts, mgs, base, out):
    """Fuse ``nodes`` as two parts (split_nodes), each recursively."""
    a, b = split_nodes(nodes)
    reads_b = {v for n in b for v in n.inputs}
    a_in, a_out = _boundary(a, set(outputs), reads_b)
    b_in, b_out = _boundary(b, set(outputs), set())
    _fuse(a, types, [v for v in inputs if v in a_in] + [v for v in a_in if v not in inputs],
          a_out, options, consts, mgs, base, out)
    _fuse(b, types, [v for v in inputs if v in b_in] + [v for v in b_in if v not in inputs],
          b_out, options, consts, mgs, base, out)


def _fuse(nodes, types, inputs, outputs, options, consts, mgs, base, out, budget=None):
    t0 = time.perf_counter()
    sig = signature_of(nodes, types)
    budget_ops = options.schedule_budget if budget is None else budget
    seconds = options.schedule_timeout if budget is None else None
    reason = None
    kname = f"{base}_{len(out)}"
    from ..deadline import check as check_deadline
    check_deadline("layer 1 fusion", lambda: f"kernel {kname!r}" + (
        f" (first node {nodes[0].op} {nodes[0].label!r})" if nodes else ""))
    if budget is None and sig in _overlay_splits(options):
        # the rule overlay says this pattern was refused before: split it (or schedule the
        # single node unbounded) without paying the isl attempt and logging it again
        if len(nodes) == 1:
            return _fuse(nodes, types, inputs, outputs, options, consts, mgs, base, out, budget=0)
        return _split(nodes, types, inputs, outputs, options, consts, mgs, base, out)
    from .pool_kernel import pool_kernel
    # CPU only: a plane per iteration of the parallel loop, with a stack scratch of a plane
    cpu = options.target not in ("cuda", "cuda-emu")
    pooled = pool_kernel(nodes, types, inputs, outputs, consts, kname) if cpu else None
    if pooled is not None:      # pooling with its elementwise neighbours: a direct kernel, no isl
        loop, params = pooled
        flops, nbytes = _estimate(nodes, types, params)
        out.append(FusedKernel(
            loop=loop, nodes=tuple(nodes), inputs=tuple(inputs), outputs=tuple(outputs),
            param_values=tuple(params), signature=sig, parallel_dims=1, band_extents=(loop.parallel_extent,),
            tile_sizes=(), flops=flops, bytes=nbytes, reduce_form=micro_graph_reduce_form(nodes, types),
            strategy="pool", schedule_ms=0.0, total_ms=(time.perf_counter() - t0) * 1e3, micro_graphs=mgs,
            consts=dict(consts)))
        return
    try:
        expanded = expand_lower_rank(nodes, types, outputs) if len(nodes) > 1 else None
        strategy = ""
        if expanded is None:
            fs, loop, params, tiles = _schedule_and_lower(nodes, types, inputs, outputs, options, consts,
                                                          kname, budget_ops, seconds)
        else:
            try:        # as written, without isl's scheduler
                fs, loop, params, tiles = _schedule_and_lower(nodes, types, inputs, outputs, options, consts,
                                                              kname, budget_ops, seconds, use_isl=False)
            except NotOneGroup:     # lower-rank values recomputed at their consumers' shape
                xnodes, xtypes = expanded
                fs, loop, params, tiles = _schedule_and_lower(xnodes, xtypes, inputs, outputs, options, consts,
                                                              kname, budget_ops, seconds)
                strategy = f"{fs.strategy}+recompute"
    except BudgetExceeded as e:
        ms = (time.perf_counter() - t0) * 1e3
        log_refusal(options, "schedule_budget_exceeded", sig, types, list(inputs) + list(outputs), ms,
             {"budget": budget_ops, "nodes": len(nodes), "ops": [n.op for n in nodes],
              "error": str(e)[:200]})
        if len(nodes) == 1:
            return _fuse(nodes, types, inputs, outputs, options, consts, mgs, base, out, budget=0)
        reason = "budget"
    except (NotOneGroup, StorageError) as e:
        ms = (time.perf_counter() - t0) * 1e3
        log_refusal(options, "multiple_fusion_groups", sig, types, list(inputs) + list(outputs), ms,
             {"nodes": len(nodes), "ops": [n.op for n in nodes], "reason": str(e)[:300]})
        if len(nodes) == 1:
            raise CompileError(f"node {nodes[0].label!r} ({nodes[0].op}): layer 1 could not "
                               f"schedule it as one loop nest: {e}") from None
        reason = "groups"
    if reason is not None:
        return _split(nodes, types, inputs, outputs, options, consts, mgs, base, out)
    flops, nbytes = _estimate(nodes, types, params)
    out.append(FusedKernel(
        loop=loop, nodes=tuple(nodes), inputs=tuple(inputs), outputs=tuple(outputs),
        param_values=tuple(params), signature=sig, parallel_dims=fs.band,
        band_extents=tuple(fs.band_extents), tile_sizes=tuple(tiles), flops=flops, bytes=nbytes,
        reduce_form=micro_graph_reduce_form(nodes, types), strategy=strategy or fs.strategy,
        schedule_ms=fs.time_ms, total_ms=(time.perf_counter() - t0) * 1e3, micro_graphs=mgs,
        consts=dict(consts)))
