"""Layer 3: parallel stitching of independent kernels (DESIGN §7, APOLLO Algorithm 3).

Kernels with no path between them in the kernel DAG, that are memory-bound and small, are run
as one parallel region (on CPU: one thread-pool dispatch whose threads take chunks of different
kernels).  Candidates are grouped by DAG level (kernels whose inputs are all ready at the same
time), sorted by predicted cost, and Algorithm 3 tries the ``k`` largest, shrinking ``k`` until
``gain = Σ cost − max cost`` passes the threshold.  Every rejected combination is reported.

Expects kernels with ``.name``, ``.inputs``, ``.outputs`` (value names), ``.bytes``, ``.flops``
and ``.compute_bound``; returns groups (tuples of kernels, in a valid execution order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..machine import Machine


@dataclass(frozen=True)
class ParallelPolicy:
    """Tunable knobs of parallel stitching (part of the cache key via its repr).

    ``min_gain``: seconds a stitch must save; defaults to one launch (what stitching removes).
    ``max_cost``: kernels predicted to take longer than this fill the machine on their own.
    """

    min_gain: float | None = None
    max_cost: float = 200e-6
    max_group: int = 8


def _levels(kernels: Sequence) -> list[int]:
    """Longest-path depth of each kernel in the DAG given by value names (a value read before it
    is produced is not an edge, so list order is a topological order and one pass finds the
    depths; networkx's topological generations gave the same, at ~0.2 s of imports a warm
    compile)."""
    producer: dict = {}
    depth = [0] * len(kernels)
    for i, k in enumerate(kernels):
        depth[i] = max((depth[producer[v]] + 1 for v in k.inputs if v in producer), default=0)
        for v in k.outputs:
            producer[v] = i
    return depth


def stitch_parallel(kernels: Sequence, machine: Machine, policy: ParallelPolicy = ParallelPolicy(),
                    on_reject: Callable[[list, float], None] | None = None,
                    refused: frozenset = frozenset()) -> list[tuple]:
    """Group independent, small, memory-bound kernels; returns groups in execution order.

    ``kernels`` must be topologically ordered.  Kernels at the same DAG depth are independent
    (no path between them).  ``on_reject(combo, gain)`` is called for every combination tried
    and rejected, so the feedback log sees it.  ``refused``: combinations (kernel names joined
    by ``+``, as the ``parallel_rejected`` event names them) that a ``[[no_parallel]]`` rule
    overlay entry refuses: passed over without estimating or logging them again.
    """
    depth = _levels(kernels)
    threshold = machine.launch if policy.min_gain is None else policy.min_gain
    groups: list[tuple] = []
    from ..deadline import check as check_deadline
    for level in sorted(set(depth)):
        check_deadline("layer 3 parallel stitching", f"kernel level {level}")
        members = [k for k, d in zip(kernels, depth) if d == level]
        cost = {id(k): machine.cost(k.bytes, k.flops) for k in members}
        cands = [k for k in members if not k.compute_bound and cost[id(k)] <= policy.max_cost]
        singles = [k for k in members if k not in cands]
        cands.sort(key=lambda k: -cost[id(k)])
        while cands:
            k = min(len(cands), policy.max_group)
            while k > 1:
                combo = cands[:k]
                if refused and "+".join(c.name for c in combo) in refused:
                    k -= 1
                    continue
                costs = [cost[id(c)] for c in combo]
                gain = sum(costs) - max(costs)
                if gain >= threshold:
                    break
                if on_reject:
                    on_reject(combo, gain)
                k -= 1
            groups.append(tuple(cands[:k]))
            cands = cands[k:]
        groups.extend((s,) for s in singles)
    return groups
