"""Classification of primitives from their isl dataflow relations (DESIGN §4).

For an op with domain D, write W: D -> Out and reads R_k: D -> In_k:

* reduction   — W is not injective (some domain dims do not reach the output);
* broadcast   — W is injective and some R_k ∘ W⁻¹ (Out -> In_k) is not injective, i.e. several
  outputs read one input element;
* elementwise — W is injective and every Out -> In_k relation is injective;
* opaque      — declared: reorganising, compute-bound or data-dependent ops, or a read that is
  not affine.

Reads of single-element inputs (scalars, shape [1]*r) are left out of the broadcast test: they
are loaded once into a register and impose no layout on the loop nest, so ``x * 2`` stays
elementwise.  Results are cached per (op, input types, attrs).
"""
from __future__ import annotations

import threading
from functools import lru_cache

from ..ir.types import TensorType
from .registry import COMPUTED, get_op

ELEMENTWISE = "elementwise"
BROADCAST = "broadcast"
REDUCTION = "reduction"
OPAQUE = "opaque"
CLASSES = (ELEMENTWISE, BROADCAST, REDUCTION, OPAQUE)

_lock = threading.Lock()
_ctx = None


def _isl_ctx():
    global _ctx
    if _ctx is None:
        import islpy as isl
        _ctx = isl.Context()
    return _ctx


def classify(op: str, in_types: tuple[TensorType, ...], out_types: tuple[TensorType, ...], attrs) -> str:
    """The class of primitive ``op`` applied to ``in_types`` (one of :data:`CLASSES`)."""
    opdef = get_op(op)
    if opdef.kind != COMPUTED or opdef.access is None:
        return OPAQUE
    return _classify_cached(op, tuple(in_types), tuple(out_types), attrs)


@lru_cache(maxsize=4096)
def _classify_cached(op, in_types, out_types, attrs) -> str:
    acc = get_op(op).access(in_types, out_types, attrs)
    if any(r is None for r in acc.reads):
        return OPAQUE
    import islpy as isl
    with _lock:
        ctx = _isl_ctx()
        dom = isl.Set.read_from_str(ctx, acc.domain)
        write = isl.Map.read_from_str(ctx, acc.write).intersect_domain(dom)
        if not write.is_injective():
            return REDUCTION
        inv = write.reverse()
        for t, r in zip(in_types, acc.reads):
            if t.size == 1:
                continue
            read = isl.Map.read_from_str(ctx, r).intersect_domain(dom)
            if not inv.apply_range(read).is_injective():
                return BROADCAST
        return ELEMENTWISE
