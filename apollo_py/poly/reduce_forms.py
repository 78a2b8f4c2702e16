"""Canonical reduce forms (DESIGN §5, after PANAMERA as used by APOLLO).

A reduction's dims are flattened into one of three 1-D/2-D forms, so that codegen needs one
template per form and target:

* ``all`` — ``[R]``: every (non-unit) dim is reduced;
* ``x``   — ``[P, R]``: the reduced dims are the innermost ones (contiguous rows);
* ``y``   — ``[R, P]``: the reduced dims are the outermost ones (reduce across rows).

Size-1 dims are ignored.  When kept and reduced dims interleave (seed 001 listing 3: a sum over
axes 1 and 3 of ``[M, N, P, Q]``), the loop nest is transposed first (listing 3 -> 4): kept dims
then reduced dims (``x``) if the innermost dim is reduced, else reduced then kept (``y``);
``perm`` gives the loop order as a permutation of the input dims and ``transposed`` says so.

Naming note: DESIGN.md names the forms by layout ([P, R] = x-reduce); the seed's digest names
them by the reduced loop (y-reduce for listing 4).  This module follows DESIGN.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping, Sequence

ALL = "all"
X = "x"
Y = "y"


@dataclass(frozen=True)
class ReduceForm:
    """A reduction flattened to a canonical form.

    ``kind`` is ALL, X or Y; ``P`` kept elements, ``R`` reduced elements per output;
    ``perm`` the input dims in loop order (outer to inner, unit dims dropped);
    ``kept`` / ``reduced`` the input dims of each kind (unit dims dropped).
    """

    kind: str
    P: int
    R: int
    perm: tuple
    kept: tuple
    reduced: tuple
    transposed: bool

    @property
    def shape(self) -> tuple:
        """The flattened loop shape: (R,), (P, R) or (R, P)."""
        if self.kind == ALL:
            return (self.R,)
        return (self.P, self.R) if self.kind == X else (self.R, self.P)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "P": self.P, "R": self.R, "perm": list(self.perm),
                "transposed": self.transposed}


def classify_reduce(shape: Sequence[int], axes: Sequence[int]) -> ReduceForm:
    """The canonical form of reducing a tensor of ``shape`` over ``axes`` (non-negative)."""
    axes = {a % max(len(shape), 1) for a in axes}
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    kept = tuple(d for d in dims if d not in axes)
    red = tuple(d for d in dims if d in axes)
    P = prod(shape[d] for d in kept)
    R = prod(shape[d] for d in red)
    if not kept:
        return ReduceForm(ALL, 1, R, red, kept, red, False)
    if not red:       # nothing reduced: a copy, treated as an x-reduce with R = 1
        return ReduceForm(X, P, 1, kept, kept, red, False)
    flags = [d in axes for d in dims]
    runs = [flags[0]] + [f for a, f in zip(flags, flags[1:]) if f != a]
    if runs == [False, True]:
        return ReduceForm(X, P, R, tuple(dims), kept, red, False)
    if runs == [True, False]:
        return ReduceForm(Y, P, R, tuple(dims), kept, red, False)
    if flags[-1]:
        return ReduceForm(X, P, R, kept + red, kept, red, True)
    return ReduceForm(Y, P, R, red + kept, kept, red, True)


def node_reduce_form(node, types: Mapping) -> ReduceForm | None:
    """The form of a ``reduce_*`` node (None for other ops, window reductions included)."""
    if not node.op.startswith("reduce_"):
        return None
    return classify_reduce(types[node.inputs[0]].shape, tuple(node.attrs["axes"]))


def micro_graph_reduce_form(nodes: Sequence, types: Mapping) -> ReduceForm | None:
    """The form of the last reduction of a micro-graph (None if it has none)."""
    for n in reversed(list(nodes)):
        f = node_reduce_form(n, types)
        if f is not None:
            return f
    return None
