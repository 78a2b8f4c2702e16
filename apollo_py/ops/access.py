"""Builders for the isl text of iteration domains and access relations.

Relations are written with concrete sizes; statement ``S``, output ``Out``, inputs ``In<k>``.
"""
from __future__ import annotations

from typing import Sequence

from .registry import Access


def ivars(n: int, prefix: str = "i") -> list[str]:
    return [f"{prefix}{k}" for k in range(n)]


def box(names: Sequence[str], shape: Sequence[int]) -> str:
    return " and ".join(f"0 <= {v} < {d}" for v, d in zip(names, shape)) or "true"


def domain_set(names: Sequence[str], shape: Sequence[int], extra: str = "") -> str:
    cond = box(names, shape)
    if extra:
        cond = f"{cond} and {extra}"
    return f"{{ S[{', '.join(names)}] : {cond} }}"


def rel(names: Sequence[str], target: str, index: Sequence[str]) -> str:
    return f"{{ S[{', '.join(names)}] -> {target}[{', '.join(index)}] }}"


def broadcast_index(out_vars: Sequence[str], out_shape: Sequence[int], in_shape: Sequence[int]) -> list[str]:
    """Index of an input read under numpy broadcasting to ``out_shape``."""
    off = len(out_shape) - len(in_shape)
    idx = []
    for j, d in enumerate(in_shape):
        idx.append("0" if d == 1 and out_shape[off + j] != 1 else out_vars[off + j])
    return idx


def broadcast_access(in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int]) -> Access:
    """Access of an op whose domain is the output and whose inputs broadcast to it."""
    v = ivars(len(out_shape))
    reads = tuple(rel(v, f"In{k}", broadcast_index(v, out_shape, s)) for k, s in enumerate(in_shapes))
    return Access(domain_set(v, out_shape), rel(v, "Out", v), reads)


def reduce_access(in_shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> Access:
    """Access of a reduction over ``axes``: domain = input space, write drops reduced dims."""
    v = ivars(len(in_shape))
    out_idx = [("0" if keepdims else None) if k in axes else x for k, x in enumerate(v)]
    out_idx = [x for x in out_idx if x is not None]
    return Access(domain_set(v, in_shape), rel(v, "Out", out_idx), (rel(v, "In0", v),))


def window_access(in_shape, out_shape, kernel, strides, pads, dilations) -> Access:
    """Access of a sliding-window reduction over the trailing ``len(kernel)`` dims.

    Domain ``S[out..., k...]`` restricted to windows that read inside the (unpadded) input;
    write ``Out[out...]`` (not injective: a reduction); read ``In0[..., o*s + k*d - p]``.
    """
    nsp = len(kernel)
    lead = len(in_shape) - nsp
    o = ivars(len(out_shape), "o")
    k = ivars(nsp, "k")
    conds = [box(k, kernel)]
    idx = list(o[:lead])
    for s in range(nsp):
        e = f"{strides[s]}*{o[lead + s]} + {dilations[s]}*{k[s]} - {pads[s]}"
        idx.append(e)
        conds.append(f"0 <= {e} < {in_shape[lead + s]}")
    dom = domain_set(o + k, list(out_shape), " and ".join(conds))
    return Access(dom, rel(o + k, "Out", o), (rel(o + k, "In0", idx),))
