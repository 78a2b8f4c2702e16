"""Layer 2: memory stitching across reductions (DESIGN §6, APOLLO Table 2 / Algorithm 2).

Supplementary rules, applied greedily to pairs whose producer is a reduction:

* rule 7 — reduction -> elementwise/broadcast consumer with the same parallel (kept) dims,
  when the per-row intermediate fits in L1-sized scratch;
* rule 8 — reduction -> reduction with an identical canonical reduce form and parallel dims.

"Same parallel dims" is checked on shapes: the stitch group has a row space ``P`` (the kept
dims of its first reduction, which must be an x-reduce: reduced dims innermost) and every member
must compute over ``P + R`` or ``P + 1...`` shaped values.  A stitched group is handed to layer 1
as one node set; if layer 1 does not return exactly one kernel, the stitch is undone and a
``stitch_rejected`` event is logged.
"""
from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from ..ir.types import TensorType
from ..poly.reduce_forms import X, node_reduce_form

L1_SCRATCH_BYTES = 32 * 1024


def _row_space(m, types) -> tuple[int, tuple] | None:
    """(P, full shape) of a reduction micro-graph whose reduce form is x (reduced dims inner)."""
    for n in m.nodes:
        if n.op.startswith("reduce_"):
            form = node_reduce_form(n, types)
            if form is None or form.kind != X or form.transposed:
                return None
            return form.P, types[n.inputs[0]].shape
    return None


def _fits(m, P: int, full: tuple, types: Mapping[str, TensorType]) -> bool:
    """Whether every value ``m`` computes lives in the row space (P rows of the full shape)."""
    R = prod(full) // max(P, 1)
    for n in m.nodes:
        for v in n.outputs:
            size = types[v].size
            if size not in (P, P * R):
                return False
    return True


def stitch_groups(micro_graphs: Sequence, types: Mapping[str, TensorType]) -> list[list[int]]:
    """Greedy grouping of micro-graph indices (topological order kept inside each group).

    A group starts at a reduction micro-graph; following micro-graphs join while they read a
    value produced in the group (producer-consumer), are elementwise/broadcast/reduction, live in
    the same row space, and nothing between them in program order is skipped (so stitching
    never reorders across an unrelated micro-graph, which keeps the DAG acyclic).
    """
    groups: list[list[int]] = []
    k = 0
    n = len(micro_graphs)
    while k < n:
        m = micro_graphs[k]
        rs = _row_space(m, types) if m.kind == "reduction" else None
        group = [k]
        if rs is not None:
            P, full = rs
            R = prod(full) // max(P, 1)
            row_bytes = R * types[m.nodes[0].outputs[0]].itemsize
            produced = set(m.outputs)
            j = k + 1
            while j < n and row_bytes <= L1_SCRATCH_BYTES:
                c = micro_graphs[j]
                if c.kind not in ("elementwise", "broadcast", "reduction"):
                    break
                if not produced.intersection(c.inputs) or not _fits(c, P, full, types):
                    break
                if c.kind == "reduction" and _row_space(c, types) != rs:
                    break
                group.append(j)
                produced.update(c.outputs)
                j += 1
        groups.append(group)
        k = group[-1] + 1
    return groups
