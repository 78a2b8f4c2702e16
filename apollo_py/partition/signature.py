"""Pattern signatures: a canonical string for a micro-graph's shape of computation.

The signature lists the micro-graph's primitives as ``op:class(args)`` in a canonical order,
where an argument is the position of an internal producer (``3``, or ``3.1`` for a second
output) or an external input (``$0``, ``$1``, numbered by first use).  It depends on ops,
classes and internal edges only — not on value names, node order, shapes or attributes — so
the same pattern in two models (or twelve BERT layers) has one signature.  It is the key of
feedback events and of ``disable_for`` entries in a rule overlay.

Canonical order: by depth inside the micro-graph, then by a hash of the node's op, class and
inputs (forward), then by a hash of how internal consumers use it (backward) — the backward
hash separates ``sub(exp(x), exp(y))``'s two operands.  Nodes still tied are interchangeable.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

from ..ir.graph import Node

CLASS_ABBREV = {"elementwise": "ew", "broadcast": "bc", "reduction": "red", "opaque": "opq", "fallback": "fb"}


def _h(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def pattern_signature(nodes: Sequence[Node], classes: Sequence[str]) -> str:
    """Canonical signature of the micro-graph made of ``nodes`` (topologically ordered), whose
    primitive classes are ``classes``."""
    produced: dict[str, tuple[int, int]] = {}
    for i, n in enumerate(nodes):
        for j, o in enumerate(n.outputs):
            produced[o] = (i, j)
    fkey: list[str] = []
    depth: list[int] = []
    for i, n in enumerate(nodes):
        args, d = [], 0
        for v in n.inputs:
            src = produced.get(v)
            if src is None:
                args.append("$")
            else:
                args.append(f"{fkey[src[0]]}.{src[1]}")
                d = max(d, depth[src[0]] + 1)
        fkey.append(_h(f"{n.op}:{classes[i]}({','.join(args)})"))
        depth.append(d)
    uses: list[list[str]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for pos, v in enumerate(n.inputs):
            src = produced.get(v)
            if src is not None:
                uses[src[0]].append(f"{fkey[i]}@{pos}.{src[1]}")
    bkey = [_h("|".join(sorted(u))) for u in uses]
    order = sorted(range(len(nodes)), key=lambda i: (depth[i], fkey[i], bkey[i]))
    where = {i: k for k, i in enumerate(order)}
    externals: dict[str, int] = {}
    parts = []
    for i in order:
        n = nodes[i]
        args = []
        for v in n.inputs:
            src = produced.get(v)
            if src is None:
                args.append(f"${externals.setdefault(v, len(externals))}")
            else:
                args.append(f"{where[src[0]]}" + (f".{src[1]}" if src[1] else ""))
        parts.append(f"{n.op}:{CLASS_ABBREV.get(classes[i], classes[i])}({','.join(args)})")
    return " ".join(parts)
