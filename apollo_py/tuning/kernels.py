"""Code decisions for generated (layer-1) kernels: vector width and parallel dim (``kernel:``
pieces; docs/design/tuning.md).

Both are applied to the kernel's loop IR after layer 1 (:func:`tuned_loop`), before LLVM,
so the layer-1 store and memo are not involved and the rendered text -- the object cache's
key -- differs from the default kernel's:

* ``{"vector_width": 256}``: the kernel's ``prefer-vector-width`` (``L.Kernel.vector_width``;
  the host's default is 512 bits with AVX-512, codegen/llvm.py);
* ``{"parallel_dim": 1}``: the runtime splits the *second* member of the kernel's coincident
  outer band instead of the first (layer 1 marks the outermost): each chunk then runs the
  whole first loop and its share of the second.  Offered only where that loop is certainly a
  band member: untiled band of at least two, the outer loop's body exactly one loop whose
  extent is the second member's, not the innermost (vector) loop.
"""
from __future__ import annotations

from ..codegen import loopir as L

#: the kernel decisions' fields and the values a stored decision may hold
VECTOR_WIDTHS = (128, 256, 512)


def host_vector_width() -> int:
    """The width (bits) LLVM prefers for this host's kernels by default."""
    from ..codegen.llvm import host
    return 512 if "+avx512f" in host().features.split(",") else 256


def _strip(s):
    while isinstance(s, L.Block) and len(s.stmts) == 1:
        s = s.stmts[0]
    return s


def _extent(f: L.For):
    if isinstance(f.lo, L.Const) and isinstance(f.hi, L.Const):
        return int(f.hi.value) - int(f.lo.value)
    return None


def second_parallel(fused) -> L.Kernel | None:
    """``fused.loop`` with the parallel mark moved to its band's second member, or None where
    that loop is not certainly one (see the module docs)."""
    k = fused.loop
    ext = tuple(getattr(fused, "band_extents", ()) or ())
    if getattr(fused, "parallel_dims", 0) < 2 or getattr(fused, "tile_sizes", ()) or len(ext) < 2 or ext[1] <= 1:
        return None
    outer = L.outer_parallel_loop(k)
    if outer is None or _extent(outer) != ext[0]:
        return None
    inner = _strip(outer.body)
    if not isinstance(inner, L.For) or inner.kind != "serial" or _extent(inner) != ext[1]:
        return None
    new_inner = L.For(inner.var, inner.lo, inner.hi, inner.body, "parallel")
    new_outer = L.For(outer.var, outer.lo, outer.hi, new_inner, "serial")

    def swap(s):
        if s is outer:
            return new_outer
        if isinstance(s, L.Block):
            return L.Block(tuple(swap(x) for x in s.stmts))
        if isinstance(s, L.For):
            return L.For(s.var, s.lo, s.hi, swap(s.body), s.kind)
        if isinstance(s, L.If):
            return L.If(s.cond, swap(s.then), swap(s.else_) if s.else_ is not None else None)
        return s
    out = k.replace(body=swap(k.body), parallel_var=inner.var.name, parallel_extent=ext[1])
    L.verify_kernel(out)
    return out


def tuned_loop(fused, decision) -> L.Kernel | None:
    """The loop IR of layer-1 kernel ``fused`` under a ``kernel:`` ``decision``, or None when
    the decision changes no code (no code field, or one this kernel cannot take: a database
    outlives the code that wrote it)."""
    if not decision:
        return None
    k, changed = fused.loop, False
    if decision.get("parallel_dim") == 1:
        alt = second_parallel(fused)
        if alt is not None:
            k, changed = alt, True
    w = decision.get("vector_width")
    if w in VECTOR_WIDTHS and w != host_vector_width():
        k, changed = k.replace(vector_width=w), True
    return k if changed else None


def kernel_code_candidates(fused) -> dict[str, dict]:
    """Round label -> the code field a ``kernel:`` candidate adds for ``fused`` (only those
    that change its code)."""
    out = {}
    if host_vector_width() == 512:
        out["vector 256"] = {"vector_width": 256}
    if second_parallel(fused) is not None:
        out["parallel dim 1"] = {"parallel_dim": 1}
    return out
