"""Einsum as a decomposition into primitives: diagonals (mask + reduce_sum), sums over private
indices (reduce_sum), and pairwise contractions as transpose -> reshape -> batched matmul.

Same conventions as :mod:`apollo_py.ops.compound` (GraphBuilder ``b``, static shapes,
ShapeError for inconsistent equations or shapes).
"""
from __future__ import annotations

import string
from math import prod

import numpy as np

from ..errors import ShapeError
from .compound import reshape


def _parse(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Labels of each operand and of the output; '...' becomes right-aligned labels '.0', '.1'..."""
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        raise ShapeError(f"einsum equation {equation!r} has more than one '->'")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ShapeError(f"einsum equation {equation!r} has {len(terms)} operands, got {len(ranks)} inputs")
    n_ell = 0
    for t, r in zip(terms, ranks):
        if "..." in t:
            n_ell = max(n_ell, r - (len(t) - 3))
    ell = [f".{k}" for k in range(n_ell)]

    def expand(term: str, rank: int | None) -> list[str]:
        for ch in term.replace("...", ""):
            if ch not in string.ascii_letters:
                raise ShapeError(f"einsum equation {equation!r}: bad label {ch!r}")
        if "..." not in term:
            return list(term)
        if term.count("...") > 1:
            raise ShapeError(f"einsum equation {equation!r}: term {term!r} has more than one '...'")
        head, tail = term.split("...")
        k = n_ell if rank is None else rank - len(head) - len(tail)
        if k < 0:
            raise ShapeError(f"einsum term {term!r} has more labels than its operand's rank {rank}")
        return list(head) + (ell[n_ell - k:] if k else []) + list(tail)

    labels = [expand(t, r) for t, r in zip(terms, ranks)]
    for t, lab, r in zip(terms, labels, ranks):
        if len(lab) != r:
            raise ShapeError(f"einsum term {t!r} has {len(lab)} labels for an operand of rank {r}")
    if rhs is None:
        counts: dict[str, int] = {}
        for lab in labels:
            for ch in lab:
                counts[ch] = counts.get(ch, 0) + 1
        out = ell + sorted(ch for ch, c in counts.items() if c == 1 and not ch.startswith("."))
    else:
        out = expand(rhs, None)
        if len(set(out)) != len(out):
            raise ShapeError(f"einsum output {rhs!r} repeats a label")
    return labels, out


def _take_diagonals(b, x, lab: list[str]):
    """Collapse repeated labels of one operand to their diagonal."""
    while len(set(lab)) != len(lab):
        seen = {}
        for q, ch in enumerate(lab):
            if ch in seen:
                p = seen[ch]
                break
            seen[ch] = q
        n = x.shape[p]
        if x.shape[q] != n:
            raise ShapeError(f"einsum label {ch!r} has sizes {n} and {x.shape[q]} in one operand")
        eye_shape = [1] * x.type.rank
        eye_shape[p] = eye_shape[q] = n
        eye = np.eye(n, dtype=np.dtype(x.dtype)).reshape(eye_shape)
        x = b.reduce_sum(b.mul(x, b.constant(eye)), axes=(q,), keepdims=False)
        lab = lab[:q] + lab[q + 1:]
    return x, lab


def _sum_out(b, x, lab: list[str], keep: set[str]):
    axes = tuple(k for k, ch in enumerate(lab) if ch not in keep)
    if not axes:
        return x, lab
    return b.reduce_sum(x, axes=axes, keepdims=False), [ch for ch in lab if ch in keep]


def _permute(b, x, lab: list[str], order: list[str]):
    perm = tuple(lab.index(ch) for ch in order)
    if perm != tuple(range(len(perm))):
        x = b.transpose(x, perm=perm)
    return x


def _contract(b, x, lx, y, ly, keep: set[str]):
    """Contract two operands over their shared labels not in ``keep``; returns (value, labels)."""
    x, lx = _sum_out(b, x, lx, keep | set(ly))
    y, ly = _sum_out(b, y, ly, keep | set(lx))
    sizes = {}
    for v, lab in ((x, lx), (y, ly)):
        for ch, d in zip(lab, v.shape):
            if sizes.get(ch, 1) not in (1, d) and d != 1:
                raise ShapeError(f"einsum label {ch!r} has sizes {sizes[ch]} and {d}")
            sizes[ch] = max(sizes.get(ch, 1), d) if d != 0 and sizes.get(ch) != 0 else 0
    # broadcast size-1 dims of shared labels so the matmul sees equal sizes
    shared = [ch for ch in lx if ch in ly]
    for which in (0, 1):
        v, lab = (x, lx) if which == 0 else (y, ly)
        target = tuple(sizes[ch] if ch in shared else d for ch, d in zip(lab, v.shape))
        if target != v.shape:
            v = b.broadcast_to(v, shape=target)
        if which == 0:
            x = v
        else:
            y = v
    batch = [ch for ch in shared if ch in keep]
    contr = [ch for ch in shared if ch not in keep]
    left = [ch for ch in lx if ch not in ly]
    right = [ch for ch in ly if ch not in lx]
    bs = [sizes[ch] for ch in batch]
    ls, ks, rs = (prod(sizes[ch] for ch in g) for g in (left, contr, right))
    xm = reshape(b, _permute(b, x, lx, batch + left + contr), bs + [ls, ks])
    ym = reshape(b, _permute(b, y, ly, batch + contr + right), bs + [ks, rs])
    z = b.matmul(xm, ym)
    z = reshape(b, z, bs + [sizes[ch] for ch in left] + [sizes[ch] for ch in right])
    return z, batch + left + right


def einsum(b, equation: str, xs):
    """numpy/ONNX einsum of Values ``xs`` (explicit or implicit output, '...', diagonals)."""
    labels, out = _parse(equation, [x.type.rank for x in xs])
    ops = []
    for x, lab in zip(xs, labels):
        x, lab = _take_diagonals(b, x, lab)
        ops.append((x, lab))
    for k in range(len(ops)):
        later = set(out).union(*(set(lab) for j, (_, lab) in enumerate(ops) if j != k))
        ops[k] = _sum_out(b, ops[k][0], ops[k][1], later)
    cur, lab = ops[0]
    for k in range(1, len(ops)):
        keep = set(out).union(*(set(lb) for _, lb in ops[k + 1:]))
        cur, lab = _contract(b, cur, lab, ops[k][0], ops[k][1], keep)
    cur, lab = _sum_out(b, cur, lab, set(out))
    missing = [ch for ch in out if ch not in lab]
    if missing:
        raise ShapeError(f"einsum output labels {missing} do not appear in the inputs of {equation!r}")
    return _permute(b, cur, lab, out)
