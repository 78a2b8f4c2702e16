"""Layer 2: memory stitching across reductions (DESIGN §6, APOLLO Table 2 / Algorithm 2).

Supplementary rules, applied greedily to pairs whose producer is a reduction:

* rule 7 — reduction -> elementwise/broadcast consumer with the same parallel (kept) dims,
  when the per-row intermediate fits in scratch;
* rule 8 — reduction -> reduction with an identical canonical reduce form and parallel dims.

"Same parallel dims" is checked on shapes: the stitch group has a row space ``P`` (the kept
dims of its first reduction, in any canonical form: x, y or all, transposed or not) and every
member must compute over ``P + R`` or ``P + 1...`` shaped values.  Which members may join
depends on the form (docs/design/stitching.md):

* a *tail* member computes only row-space values (``P`` elements: ``sqrt`` of a mean, the
  ``log``/``add`` of a logsumexp, an eps added to a variance): it always joins, whatever the
  form and the row length — it only removes a launch and a round trip of ``P`` values;
* a *full-size* member (values of ``P * R`` elements: ``x - max``, ``exp``, a normalisation)
  joins an x-reduce (transposed or not) when one row of ``R`` elements fits the scratch
  (``STITCH_SCRATCH_BYTES``).  A y-reduce never takes one: its stitched passes would walk
  columns, measured 1.7x slower than row-major elementwise kernels beside the column
  reductions.  Nor does an all-reduce: with no kept dim there is no shared parallel band, and
  layer 1 cannot put two passes over the whole tensor into one nest (it refuses the stitch).

A stitched group is handed to layer 1 as one node set; if layer 1 does not return exactly one
kernel, the stitch is undone and a ``stitch_rejected`` event is logged (layers/lowering.py).

:func:`absorb_concats` then makes a ``concat`` an index map of the kernel that computes its
inputs: the producers' groups join the concat's, and layer 1 writes each input into its slice
of the concat output (poly/statements.py), so no numpy copy step remains.
"""
from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from ..ir.types import TensorType
from ..poly.reduce_forms import X, node_reduce_form

#: largest row (R elements of one kept point) a stitched full-size member may re-read: layer 1
#: keeps such a row as a scratch tile (poly/storage.py allows 64 Ki elements), and a row of
#: this size stays in L2 between the passes of a stitched kernel, where the unstitched kernels
#: would each stream it from memory again
STITCH_SCRATCH_BYTES = 256 * 1024
#: kept for callers of the old name (the per-row limit before forms other than x were stitched)
L1_SCRATCH_BYTES = STITCH_SCRATCH_BYTES

KERNEL_KINDS = ("elementwise", "broadcast", "reduction")
#: most producer groups one concat absorbs (each is a loop nest of the one kernel layer 1 tries)
MAX_ABSORBED = 16


def _row_space(m, types) -> tuple | None:
    """(P, full shape, form) of a reduction micro-graph's first reduction, any canonical form."""
    for n in m.nodes:
        if n.op.startswith("reduce_"):
            form = node_reduce_form(n, types)
            if form is None:
                return None
            return form.P, types[n.inputs[0]].shape, form
    return None


def _sizes(m, types) -> set:
    return {types[v].size for n in m.nodes for v in n.outputs}


def _joins(c, rs, types, row_bytes: int, produced=frozenset()) -> bool:
    """Whether micro-graph ``c`` (a consumer in program order) may join the group of row space
    ``rs``; ``produced``: the values the group computes so far."""
    P, full, form = rs
    R = prod(full) // max(P, 1)
    sizes = _sizes(c, types)
    if not sizes <= {P, P * R}:
        return False
    if c.kind == "reduction":
        crs = _row_space(c, types)
        if crs is None or crs[0] != P or crs[1] != full or crs[2].kind != form.kind \
                or crs[2].kept != form.kept:
            return False
    if sizes == {P} and P != P * R:
        # a tail on the row space: always worth it after an x-reduce; after a y- or
        # all-reduce only when it reads nothing else but scalars (an optimizer update of a
        # bias reading its own state stays apart, so the runtime may run it in place)
        return form.kind == X or all(v in produced or types[v].size <= 1 for v in c.inputs)
    if row_bytes > STITCH_SCRATCH_BYTES:
        return False
    return form.kind == X


def stitch_groups(micro_graphs: Sequence, types: Mapping[str, TensorType]) -> list[list[int]]:
    """Greedy grouping of micro-graph indices (topological order kept inside each group).

    A group starts at a reduction micro-graph; following micro-graphs join while they read a
    value produced in the group (producer-consumer), are elementwise/broadcast/reduction, live in
    the same row space (see :func:`_joins`), and nothing between them in program order is
    skipped (so stitching never reorders across an unrelated micro-graph, which keeps the DAG
    acyclic).
    """
    groups: list[list[int]] = []
    k = 0
    n = len(micro_graphs)
    while k < n:
        m = micro_graphs[k]
        rs = _row_space(m, types) if m.kind == "reduction" else None
        group = [k]
        if rs is not None:
            P, full, _ = rs
            R = prod(full) // max(P, 1)
            row_bytes = R * types[m.nodes[0].outputs[0]].itemsize
            produced = set(m.outputs)
            j = k + 1
            while j < n:
                c = micro_graphs[j]
                if c.kind not in KERNEL_KINDS or not produced.intersection(c.inputs):
                    break
                if not _joins(c, rs, types, row_bytes, produced):
                    break
                group.append(j)
                produced.update(c.outputs)
                j += 1
        groups.append(group)
        k = group[-1] + 1
    return groups


def _index_map(m) -> bool:
    """A micro-graph that is one slice or transpose (an index map for layer 1)."""
    return len(m.nodes) == 1 and m.nodes[0].op in ("slice", "transpose")


def _pad_map(m) -> bool:
    """A micro-graph that is one constant-mode pad without cropping: layer 1 writes it as an
    index map of its producer (the interior) plus fills of the border (poly/statements.py)."""
    from ..poly.statements import pad_as_index_map
    return len(m.nodes) == 1 and pad_as_index_map(m.nodes[0])


def _kernelable(group, micro_graphs) -> bool:
    """Whether layer 1 may take every micro-graph of ``group`` (elementwise, broadcast,
    reduction, or a lone slice / transpose, which it reads through as an index map)."""
    return all(micro_graphs[k].kind in KERNEL_KINDS or _index_map(micro_graphs[k]) for k in group)


def _kernel_group(group, micro_graphs) -> bool:
    """A group of elementwise / broadcast / reduction micro-graphs only (an index map merges
    into such a group, never into another lone index map: chains stay simple)."""
    return all(micro_graphs[k].kind in KERNEL_KINDS for k in group)


def absorb_index_maps(groups: list[list[int]], micro_graphs: Sequence,
                      graph_outputs: Sequence[str]) -> list[list[int]]:
    """``groups`` with every lone slice / transpose micro-graph merged into a kernel group next
    to it, so that layer 1 reads (or writes) through its index map instead of a copy step:

    * into the one group that reads its result (a kernel group, later in order; nothing else
      reads the result), at that group's position;
    * else into the kernel group that produces its input (nothing else reads the input), at
      the producer's position.

    A lone constant-mode pad joins its producer's kernel group the second way only: the
    producer writes into the interior and the kernel fills the border.

    A transpose whose input comes from, or whose result goes to, a matmul / conv stays as it
    is: BLAS folding takes it as a ``trans`` flag or an operand swap (layers/blas_fold.py).
    """
    where, readers = _producers_and_readers(groups, micro_graphs)
    outs = set(graph_outputs)
    target: dict[int, tuple] = {}       # index-map group -> (kernel group, "before" | "after")
    for gi, g in enumerate(groups):
        if len(g) != 1:
            continue
        node = micro_graphs[g[0]].nodes[0]
        v, src = node.outputs[0], node.inputs[0]
        rs = readers.get(v, set())
        pi = where.get(src)
        if _pad_map(micro_graphs[g[0]]):
            # only after its producer: a kernel reading a tensor that several pieces write
            # (the padded one) inside the same nest is not supported (nor for concat)
            if pi is not None and pi not in target and src not in outs and readers.get(src, set()) == {gi} \
                    and _kernel_group(groups[pi], micro_graphs):
                target[gi] = (pi, "after")
            continue
        if not _index_map(micro_graphs[g[0]]):
            continue
        if node.op == "transpose" and any(n.op in ("matmul", "conv") for gi2 in (rs | {pi} - {None})
                                          for k in groups[gi2] for n in micro_graphs[k].nodes):
            continue        # next to a matmul: BLAS folding takes it as a trans flag / swap
        if len(rs) == 1 and v not in outs:
            (ci,) = rs
            if ci > gi and _kernel_group(groups[ci], micro_graphs):
                target[gi] = (ci, "before")
                continue
        if pi is None or pi in target or src in outs or readers.get(src, set()) != {gi}:
            continue
        if _kernel_group(groups[pi], micro_graphs):
            target[gi] = (pi, "after")
    if not target:
        return groups
    before: dict[int, list] = {}
    after: dict[int, list] = {}
    for gi, (ci, side) in target.items():
        (before if side == "before" else after).setdefault(ci, []).extend(groups[gi])
    out = []
    for gi, g in enumerate(groups):
        if gi in target:
            continue
        out.append(before.get(gi, []) + g + after.get(gi, []))
    return out


def _producers_and_readers(groups, micro_graphs) -> tuple[dict[str, int], dict[str, set]]:
    """(value -> index of the group producing it, value -> indices of the groups reading it)."""
    where: dict[str, int] = {}
    readers: dict[str, set] = {}
    for gi, g in enumerate(groups):
        for k in g:
            for v in micro_graphs[k].outputs:
                where[v] = gi
            for v in micro_graphs[k].inputs:
                readers.setdefault(v, set()).add(gi)
    return where, readers


def absorb_concats(groups: list[list[int]], micro_graphs: Sequence, graph_outputs: Sequence[str],
                   max_groups: int = MAX_ABSORBED) -> list[list[int]]:
    """``groups`` with every lone ``concat`` micro-graph merged with the groups that compute
    its inputs, at the concat's position.

    The groups merged are elementwise / broadcast / reduction groups that produce a concat
    input, and, transitively, groups whose every value is read only inside the merged set (the
    ``reduce_sum`` before a mean's ``div``); at most ``max_groups`` of them, nearest first.  A
    group moves down to the concat only when nothing between them outside the merged set
    reads what it produces, so the order stays valid.  Inputs from elsewhere (graph inputs,
    constants, other steps) are copied into their slice by the same kernel.  A concat with no
    kernel producer stays a numpy step.
    """
    where, readers = _producers_and_readers(groups, micro_graphs)
    outs_of = [{v for k in g for v in micro_graphs[k].outputs} for g in groups]
    ins_of = [{v for k in g for v in micro_graphs[k].inputs} for g in groups]
    kernel = [_kernelable(g, micro_graphs) for g in groups]
    taken: set = set()
    merged_into: dict[int, int] = {}    # producer group -> concat group it joins
    for ci, g in enumerate(groups):
        if len(g) != 1:
            continue
        m = micro_graphs[g[0]]
        if len(m.nodes) != 1 or m.nodes[0].op != "concat":
            continue
        chosen = {where[v] for v in m.nodes[0].inputs if v in where}
        chosen = {pi for pi in chosen if pi < ci and kernel[pi] and pi not in taken}
        frontier = list(chosen)
        while frontier:                 # exclusive producers of what the chosen groups read
            pi = frontier.pop()
            for v in ins_of[pi]:
                qi = where.get(v)
                if qi is None or qi in chosen or qi in taken or not kernel[qi] or qi >= ci:
                    continue
                if all(readers.get(u, set()) <= chosen for u in outs_of[qi]) \
                        and not outs_of[qi] & set(graph_outputs):
                    chosen.add(qi)
                    frontier.append(qi)
        chosen = set(sorted(chosen, reverse=True)[:max_groups])
        while True:                     # moving a group down must not pass one of its readers
            bad = {pi for pi in chosen if any(ri not in chosen and pi < ri < ci
                                              for v in outs_of[pi] for ri in readers.get(v, ()))}
            if not bad:
                break
            chosen -= bad
        for pi in chosen:
            merged_into[pi] = ci
        taken |= chosen
    if not merged_into:
        return groups
    extra: dict[int, list[int]] = {}
    for pi, ci in merged_into.items():
        extra.setdefault(ci, []).extend(groups[pi])
    return [sorted(extra[gi]) + g if gi in extra else g for gi, g in enumerate(groups) if gi not in merged_into]
