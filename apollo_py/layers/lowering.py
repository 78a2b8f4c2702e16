"""From micro-graphs to executable steps for the CPU target (layers 2 and 1, then codegen).

For each micro-graph, in order:

* fallback ops and opaque reorganising ops (reshape, slice, concat, pad, gather) have no
  loop-nest lowering yet: they run through their numpy references (a reference step); a
  transpose of at least ``TRANSPOSE_KERNEL_MIN`` elements is a generated copy kernel;
* a matmul/conv micro-graph runs on the generated GEMM (codegen/gemm.py) with the longest
  fusable prefix of its elementwise epilogue (rule 6) applied per C tile; where the measured
  rule in gemm_lowering.py picks BLAS (small or thin float32 products, other dtypes), numpy runs
  the head and the epilogue becomes one layer-1 kernel -- the plan says which and why;
* elementwise / broadcast / reduction micro-graphs are stitched by layer 2 and fused by layer 1
  into loop-IR kernels.

Every choice that is not a generated kernel is recorded with its reason; a layer-1 failure on a
micro-graph falls back to a reference step and says why.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import CompileError
from ..ir.graph import Graph
from ..options import Options
from .fuse_memo import fuse_nodes
from .layer2 import absorb_concats, absorb_index_maps, stitch_groups
from .steps import StepSpec

REFERENCE_OPS = {"reshape", "transpose", "slice", "concat", "pad", "gather", "onnx_op", "scatter_add",
                 "constant", "recurrent", "resize2d"}
BLAS_OPS = {"matmul", "conv"}


def _boundary(nodes, graph: Graph, later_reads: set) -> tuple[tuple, tuple]:
    produced = {o for n in nodes for o in n.outputs}
    ins = tuple(dict.fromkeys(v for n in nodes for v in n.inputs if v not in produced))
    outs = tuple(o for n in nodes for o in n.outputs if o in later_reads or o in graph.outputs)
    return ins, outs


def lower_micro_graphs(graph: Graph, micro_graphs: Sequence, options: Options,
                       progress=None) -> list[StepSpec]:
    """Steps (in execution order) computing ``graph`` from its micro-graphs.

    ``progress`` (a :class:`apollo_py.progress.Progress` or None) counts micro-graphs done.
    """
    types = graph.types
    from ..tuning.db import decisions as tuning_decisions
    tuned = tuning_decisions(options)       # {} unless a tuning database has this machine's entries
    groups, reads_after, keys = lowering_groups(graph, micro_graphs, options, tuned)

    from ..deadline import check as check_deadline
    steps: list[StepSpec] = []
    base_options = options
    skip: set = set()
    for gi, group in enumerate(groups):
        if gi in skip:      # lowered with the group before it (a conv's fused squeeze)
            continue
        check_deadline("layer 1 fusion", lambda: _micro_graph_label(micro_graphs, group))
        if progress is not None:
            progress.step(len(group))
        members = [micro_graphs[k] for k in group]
        later = reads_after[gi]
        options = base_options
        decision = tuned.get(keys[gi]) if tuned else None
        if decision:        # the tuning database's choices for this piece (tuning/db.py)
            if "tiles" in decision:
                options = options.replace(tile_sizes=tuple(decision["tiles"]) or None)
            if decision.get("gemm") in ("blas", "generated"):
                options = options.replace(gemm=decision["gemm"])
        nodes = [n for m in members for n in m.nodes]
        first = members[0]
        why = _no_kernel_reason(nodes, types)
        if why:
            ins, outs = _boundary(nodes, graph, later)
            steps.append(StepSpec(ins, outs, nodes=tuple(nodes), reason=why, micro_graphs=tuple(group)))
            continue
        if len(members) == 1 and len(nodes) == 1 and nodes[0].op == "transpose":
            spec = _transpose_step(nodes[0], graph, later, tuple(group))
            if spec is not None:
                steps.append(spec)
                continue
        if len(members) == 1 and len(nodes) == 1 and nodes[0].op == "gather" and options.target == "cpu":
            spec = _gather_step(nodes[0], graph, tuple(group))
            if spec is not None:
                steps.append(spec)
                continue
        if len(members) == 1 and len(nodes) == 1 and nodes[0].op == "resize2d" and options.target == "cpu":
            steps.append(_resize_step(nodes[0], graph, tuple(group)))
            continue
        if len(members) == 1 and len(nodes) == 1 and nodes[0].op == "recurrent":
            spec = _recurrent_step(nodes[0], graph, options, tuple(group))
            if spec is not None:
                steps.append(spec)
                continue
        if len(members) == 1 and len(nodes) == 1 and nodes[0].op == "concat" and options.target == "cpu" \
                and types[nodes[0].outputs[0]].dtype in ("float32", "float64", "int32", "int64") \
                and not _blocks_concat(nodes[0], types):
            # a concat no producer kernel absorbed (its inputs come from GEMMs, gathers, graph
            # inputs): one copy kernel, which runs inside a driver segment, instead of np.concatenate.
            # A concat whose inputs are contiguous blocks of its output stays a reference step:
            # the runtime has its producers write their blocks in place (runtime/concat.py)
            ins, outs = _boundary(nodes, graph, later)
            specs = _fuse(nodes, ins, outs, graph, options, tuple(group), members)
            if all(sp.fused is not None for sp in specs):
                steps.extend(specs)
                continue
        if len(members) == 1 and (first.kind == "fallback" or any(n.op in REFERENCE_OPS for n in nodes)):
            ins, outs = _boundary(nodes, graph, later)
            why = "fallback op (onnx.reference)" if first.kind == "fallback" else "no loop-nest lowering for " + \
                ", ".join(sorted({n.op for n in nodes if n.op in REFERENCE_OPS}))
            steps.append(StepSpec(ins, outs, nodes=tuple(nodes), reason=why, micro_graphs=tuple(group)))
            continue
        blas = [k for k, n in enumerate(nodes) if n.op in BLAS_OPS]
        if len(members) == 1 and len(blas) == 1:
            # nodes before the BLAS op (merged by rule 6, e.g. a relu mask read by the epilogue)
            # do not depend on it: they join the epilogue kernel, or run first as their own
            # kernel when the BLAS op reads them
            prologue, head, epilogue = nodes[:blas[0]], nodes[blas[0]:blas[0] + 1], nodes[blas[0] + 1:]
            if set(head[0].inputs) & {o for n in prologue for o in n.outputs}:
                i0, o0 = _boundary(prologue, graph, later | {v for n in nodes[blas[0]:] for v in n.inputs})
                steps.extend(_fuse(prologue, i0, o0, graph, options, tuple(group), members))
            else:
                epilogue = prologue + epilogue
            sq = _squeeze_next(gi, head[0], epilogue, groups, micro_graphs, graph, reads_after, options)
            if sq is not None:
                steps.extend(sq)
                skip.add(gi + 1)
                continue
            if epilogue and options.target == "cpu":
                # rule 6 puts an SE block's excitation mul into the gate's conv micro-graph
                from .conv_squeeze import fuse_excite
                sq = fuse_excite(head[0], list(epilogue[:-1]), [epilogue[-1]], graph, later, options, tuple(group))
                if sq is not None:
                    steps.append(sq)
                    continue
            from .gemm_lowering import gemm_spec
            spec, epilogue, why = gemm_spec(head[0], list(epilogue), graph, later, options, tuple(group))
            if spec is not None:
                steps.append(spec)
            else:
                later_all = later | {v for n in epilogue for v in n.inputs}
                ins, outs = _boundary(head, graph, later_all)
                steps.append(StepSpec(ins, outs, nodes=tuple(head), reason=f"{head[0].op} via numpy: {why}",
                                      micro_graphs=tuple(group)))
            nodes = epilogue
            if not nodes:
                continue
        ins, outs = _boundary(nodes, graph, later)
        steps.extend(_fuse(nodes, ins, outs, graph, options, tuple(group), members))
    if options.target == "cpu":
        from .conv_squeeze import excite_in_place
        steps = excite_in_place(steps, graph)
    return steps


def lowering_groups(graph: Graph, micro_graphs: Sequence, options: Options, tuned=None, with_keys: bool = False):
    """``(groups, reads_after, keys)``: the groups of micro-graph indices lowered as one unit
    (layer 2's stitch groups, then lone index maps and concat producers absorbed), the values
    read after each group, and each group's tuning piece key ("" unless ``tuned`` is not
    empty or ``with_keys``).

    ``tuned`` (piece key -> decision, tuning/db.py) may undo a stitch group (``{"stitch":
    false}`` under its ``stitch:`` key); so may a ``[[no_stitch]]`` overlay entry, in
    :func:`_fuse`.  The tuner (tuning/tuner.py) calls this to find the pieces it times."""
    from ..tuning.db import piece_key
    types = graph.types
    groups = stitch_groups(micro_graphs, types)
    if tuned:
        split = []
        for g in groups:
            if len(g) > 1 and (tuned.get(stitch_key(g, micro_graphs, types)) or {}).get("stitch") is False:
                split.extend([k] for k in g)
            else:
                split.append(g)
        groups = split
    groups = absorb_index_maps(groups, micro_graphs, graph.outputs)
    groups = absorb_concats(groups, micro_graphs, graph.outputs)
    # values read after each group, in the groups' order (the absorb passes move index maps
    # and concat producers, so micro-graph order no longer says what is read later)
    reads_after: list[set] = []
    acc: set = set(graph.outputs)
    for group in reversed(groups):
        reads_after.append(set(acc))
        acc |= {v for k in group for v in micro_graphs[k].inputs}
    reads_after.reverse()
    keys = [""] * len(groups)
    if tuned or with_keys:
        for gi, g in enumerate(groups):
            nodes = [n for k in g for n in micro_graphs[k].nodes]
            keys[gi] = piece_key("group", nodes, types, _boundary(nodes, graph, reads_after[gi])[1])
    return groups, reads_after, keys


def stitch_key(group, micro_graphs, types) -> str:
    """Tuning piece key of a layer-2 stitch group (its micro-graphs' nodes)."""
    from ..tuning.db import piece_key
    return piece_key("stitch", [n for k in group for n in micro_graphs[k].nodes], types)


def _squeeze_next(gi: int, head, epilogue, groups, micro_graphs, graph: Graph, reads_after, options: Options):
    """The steps of group ``gi`` and the next one when that is a conv followed by a
    global-average-pool squeeze or excitation multiply fused into it, or by a squeeze whose
    elementwise chain the conv's GEMM takes as its epilogue (layers/conv_squeeze.py); None
    otherwise."""
    if gi + 1 >= len(groups) or options.target != "cpu":
        return None
    nxt = groups[gi + 1]
    if any(micro_graphs[k].kind not in ("reduction", "elementwise", "broadcast") for k in nxt):
        return None
    from .conv_squeeze import fuse_excite, fuse_squeeze, fuse_squeeze_chain
    nodes = [n for k in nxt for n in micro_graphs[k].nodes]
    for fuse in (fuse_squeeze, fuse_excite):
        spec = fuse(head, list(epilogue), nodes, graph, reads_after[gi + 1], options, (*groups[gi], *nxt))
        if spec is not None:
            return [spec]
    if not SQUEEZE_CHAIN:
        return None
    got = fuse_squeeze_chain(head, list(epilogue), nodes, graph, reads_after[gi + 1], options, tuple(groups[gi]))
    if got is None:
        return None
    spec, rest = got
    ins, outs = _boundary(rest, graph, reads_after[gi + 1])
    return [spec, *_fuse(rest, ins, outs, graph, options, tuple(nxt), [micro_graphs[k] for k in nxt])]


#: a GEMM conv takes the elementwise chain of the squeeze after it as its epilogue
#: (conv_squeeze.fuse_squeeze_chain); off: the reduction kernel applies it (A/B runs)
SQUEEZE_CHAIN = True


def _micro_graph_label(micro_graphs, group) -> str:
    """"micro-graph 3 (first node 'add_7', 4 nodes)" -- where a compile timeout names the work."""
    m = micro_graphs[group[0]]
    nodes = [n for k in group for n in micro_graphs[k].nodes]
    first = f"{nodes[0].op} {nodes[0].label!r}" if nodes else "?"
    src = f" from ONNX node {nodes[0].source[0]!r}" if nodes and nodes[0].source else ""
    more = f"-{group[-1]}" if len(group) > 1 else ""
    return f"micro-graph {group[0]}{more} ({m.kind}, {len(nodes)} nodes, first {first}{src})"


def _no_kernel_reason(nodes, types) -> str:
    """Why ``nodes`` run as a numpy step whatever their ops ("" when a kernel may be tried).

    A zero-size tensor anywhere (empty output, or a reduction over an empty set, whose result
    is the reduction's identity) has nothing to loop over: the numpy references handle it.
    A dtype the loop IR has no code for runs through numpy too (none today: loopir.DTYPES
    covers every IR dtype; kept so that a new IR dtype never fails on target="cpu").
    """
    from ..codegen.loopir import DTYPES as CODEGEN_DTYPES
    vals = {v for n in nodes for v in (*n.inputs, *n.outputs)}
    if any(types[v].size == 0 for v in vals):
        return "zero-size tensor (nothing to loop over; numpy gives the empty result or identity)"
    bad = sorted({types[v].dtype for v in vals} - set(CODEGEN_DTYPES))
    if bad:
        return f"dtype {', '.join(bad)} has no loop-IR code (numpy reference)"
    return ""


#: transposes with fewer elements stay numpy steps (a kernel's compile costs more than it saves)
TRANSPOSE_KERNEL_MIN = 4096


def _transpose_step(node, graph: Graph, later: set, group: tuple):
    """A generated copy kernel for a transpose (codegen.templates.transpose_kernel), or None
    when it stays a numpy step (small, or a dtype without a loop-IR buffer type)."""
    import hashlib

    from ..codegen.templates import transpose_kernel
    from .layer1 import FusedKernel
    t_in, t_out = graph.types[node.inputs[0]], graph.types[node.outputs[0]]
    if t_in.dtype not in ("float32", "float64", "int32", "int64") or t_in.size < TRANSPOSE_KERNEL_MIN:
        return None
    perm = tuple(int(p) for p in node.attrs["perm"])
    # named by structure, not by value names: the same transpose in every layer is one piece
    name = "copy_" + hashlib.sha1(f"{t_in.dtype}{t_in.shape}{perm}".encode()).hexdigest()[:10]
    loop = transpose_kernel(name, t_in.shape, perm, t_in.dtype)
    ins, outs = (node.inputs[0],), (node.outputs[0],)
    fused = FusedKernel(loop=loop, nodes=(node,), inputs=ins, outputs=outs, param_values=ins + outs,
                        signature="transpose", parallel_dims=1 if loop.parallel_var else 0,
                        band_extents=(loop.parallel_extent,) if loop.parallel_var else (), tile_sizes=(),
                        flops=0, bytes=t_in.nbytes + t_out.nbytes, reduce_form=None, strategy="copy",
                        schedule_ms=0.0, total_ms=0.0)
    return StepSpec(ins, outs, fused=fused, micro_graphs=group)


def gather_error_value(node) -> str:
    """Name of the one-word error buffer of gather ``node``'s kernel (not a graph value: each
    arena holds one, runtime/cpu.py checks it after a call)."""
    return "__err__" + node.outputs[0]


def _gather_step(node, graph: Graph, group: tuple):
    """A generated gather kernel (codegen/gather.py) with its error word, or None when the
    gather stays a numpy step (a dtype the kernel does not copy)."""
    import hashlib

    from ..codegen.gather import DATA_DTYPES, gather_kernel
    from .layer1 import FusedKernel
    data, idx = (graph.types[v] for v in node.inputs)
    out = graph.types[node.outputs[0]]
    if data.dtype not in DATA_DTYPES or idx.dtype not in ("int32", "int64") or out.size == 0:
        return None
    ax = int(node.attrs["axis"])
    pre, n, m = int(np.prod(data.shape[:ax], dtype=np.int64)), int(data.shape[ax]), int(idx.size)
    post = int(np.prod(data.shape[ax + 1:], dtype=np.int64))
    # named by structure: lookups into tables of one shape share one compiled kernel
    name = "gather_" + hashlib.sha1(f"{data.dtype}{idx.dtype}{pre},{n},{m},{post}".encode()).hexdigest()[:10]
    loop = gather_kernel(name, pre, n, m, post, data.dtype, idx.dtype)
    ins, outs = tuple(node.inputs), (node.outputs[0],)
    fused = FusedKernel(loop=loop, nodes=(node,), inputs=ins, outputs=outs,
                        param_values=ins + outs + (gather_error_value(node),), signature="gather",
                        parallel_dims=1, band_extents=(loop.parallel_extent,), tile_sizes=(), flops=0,
                        bytes=2 * out.nbytes + idx.nbytes, reduce_form=None, strategy="gather",
                        schedule_ms=0.0, total_ms=0.0)
    return StepSpec(ins, outs, fused=fused, micro_graphs=group)


def _resize_step(node, graph: Graph, group: tuple):
    """The generated kernel of a ``resize2d`` node (codegen/resize.py; ops/resize2d.py says why)."""
    import hashlib

    from ..codegen import resize as R
    from .layer1 import FusedKernel
    x, out = graph.types[node.inputs[0]], graph.types[node.outputs[0]]
    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    taps = int(node.attrs["taps"])
    consts = {v: nd.attrs["value"].array for nd in graph.nodes if nd.op == "constant" for v in nd.outputs}
    tx, wx = (consts.get(v) for v in node.inputs[3:5])
    phases = None if tx is None or wx is None or not R.PHASES else R.find_phases(np.asarray(tx), np.asarray(wx))
    # named by structure: resizes of one shape and column pattern share one compiled kernel
    # (the tables are params; the phase form inlines its periodic weights)
    name = "resize_" + hashlib.sha1(f"{x.dtype}{n * c},{h},{w},{oh},{ow},{taps},{phases}".encode()).hexdigest()[:10]
    loop = R.resize2d_kernel(name, n * c, h, w, oh, ow, taps, x.dtype, phases)
    ins, outs = tuple(node.inputs), (node.outputs[0],)
    fused = FusedKernel(loop=loop, nodes=(node,), inputs=ins, outputs=outs, param_values=ins + outs,
                        signature="resize2d", parallel_dims=1, band_extents=(loop.parallel_extent,),
                        tile_sizes=(), flops=(3 * taps - 1) * out.size, bytes=x.nbytes + out.nbytes,
                        reduce_form=None, strategy="resize2d", schedule_ms=0.0, total_ms=0.0)
    return StepSpec(ins, outs, fused=fused, micro_graphs=group)


def _recurrent_step(node, graph: Graph, options: Options, group: tuple):
    """The generated time-loop kernel of a ``recurrent`` node (codegen/recurrent.py), or None
    when it stays a numpy step (a target other than the CPU's LLVM, or a dtype it lacks)."""
    import hashlib
    import os

    from ..codegen.recurrent import block_rows, phased, recurrent_kernel, recurrent_phased_kernel
    from .layer1 import FusedKernel
    types = graph.types
    xp, aux = types[node.inputs[0]], types[node.inputs[4]]
    if options.target != "cpu" or xp.dtype not in ("float32", "float64"):
        return None
    t_len, batch = xp.shape[:2]
    a = node.attrs
    threads = max(1, int(options.num_threads or os.cpu_count() or 1))
    key = f"{xp.dtype}{xp.shape}{aux.shape}{threads}{sorted(a.items())}"
    name = "rnn_" + hashlib.sha1(key.encode()).hexdigest()[:10]
    nd, hsz = len(a["directions"]), int(a["hidden"])
    r = types[node.inputs[1]]
    io = sum(types[v].nbytes for v in node.inputs) + sum(types[v].nbytes for v in node.outputs)
    phases = 0
    if a.get("rt"):
        if not phased(a):
            return None
        # R^T: every step's phase reads all of R once, split between the threads
        loop, _ = recurrent_phased_kernel(name, a, t_len, batch, aux.shape[1], xp.dtype, threads, int(a["rt"]))
        phases = t_len + 1
        moved = t_len * r.nbytes + io
    else:
        loop = recurrent_kernel(name, a, t_len, batch, aux.shape[1], xp.dtype, threads)
        bs = block_rows(batch, nd, threads)
        # R is read once per step per block of rows; the rest once per call
        moved = t_len * nd * -(-batch // bs) * r.nbytes // nd + io
    ins, outs = tuple(node.inputs), tuple(node.outputs)
    fused = FusedKernel(loop=loop, nodes=(node,), inputs=ins, outputs=outs, param_values=ins + outs,
                        signature="recurrent", parallel_dims=1, band_extents=(loop.parallel_extent,),
                        tile_sizes=(), flops=2 * t_len * batch * r.size, bytes=int(moved),
                        reduce_form=None, strategy="recurrent", schedule_ms=0.0, total_ms=0.0, phases=phases)
    return StepSpec(ins, outs, fused=fused, micro_graphs=group)


def _blocks_concat(node, types) -> bool:
    """True for a concat over an axis with only unit dims before it (NCHW at batch 1 over
    channels): each input is one contiguous block of the output, which runtime/concat.py can
    have the producers write in place."""
    shape = types[node.outputs[0]].shape
    axis = int(node.attrs["axis"]) % len(shape) if shape else 0
    return all(int(d) == 1 for d in shape[:axis])


def _scalar_constants(graph: Graph, values) -> list:
    """The graph's single-element ``constant`` nodes producing ``values`` (layer 1 inlines
    them as immediates, so e.g. ``pow(x, 3)`` becomes two multiplies)."""
    want = set(values)
    return [n for n in graph.nodes if n.op == "constant" and n.outputs[0] in want
            and n.attrs["value"].array.size == 1]


def _fuse(nodes, ins, outs, graph, options, group, members) -> list[StepSpec]:
    types = graph.types
    scalars = _scalar_constants(graph, ins)
    if scalars:
        inlined = {n.outputs[0] for n in scalars}
        nodes = [*scalars, *(n for n in nodes if n.op != "constant" or n.outputs[0] not in inlined)]
        ins = tuple(v for v in ins if v not in inlined)
    refused = False
    if len(members) > 1 and options.rules_overlay:
        # a [[no_stitch]] overlay entry: layer 1 refused this stitch before (feedback apply)
        from ..partition.rules import overlay_signatures
        from .layer1 import signature_of
        refused = signature_of(list(nodes), types) in overlay_signatures(options.rules_overlay, "no_stitch")
    fused, err = None, ""
    if not refused:
        try:
            fused = fuse_nodes(list(nodes), types, list(ins), list(outs), options)  # memoised layer 1
        except CompileError as e:
            fused, err = None, str(e)
    if refused or (fused is not None and len(members) > 1 and len(fused) > 1):
        # the stitch did not give one kernel: log it, then stitch the longest prefix that does
        from .layer1 import log_refusal, signature_of
        if not refused:
            log_refusal(options, "stitch_rejected", signature_of(list(nodes), types), types,
                        list(ins) + list(outs), 0.0,
                        f"layer 1 gave {len(fused)} kernels for {len(members)} stitched micro-graphs")
        cut = len(members) - 1
        head, tail = members[:cut], members[cut:]
        head_reads = {v for m in tail for v in m.inputs} | set(outs)
        head_nodes = [n for m in head for n in m.nodes]
        i1, o1 = _boundary(head_nodes, graph, head_reads)
        tail_nodes = [n for m in tail for n in m.nodes]
        i2, o2 = _boundary(tail_nodes, graph, set(outs))
        return (_fuse(head_nodes, i1, o1, graph, options, group[:cut], head)
                + _fuse(tail_nodes, i2, o2, graph, options, group[cut:], tail))
    if fused is None:
        return [StepSpec(ins, outs, nodes=tuple(nodes), reason=f"layer 1 failed: {err}", micro_graphs=group)]
    return [StepSpec(tuple(v for v in f.param_values if v not in f.outputs), tuple(f.outputs), fused=f,
                     micro_graphs=group) for f in fused]
