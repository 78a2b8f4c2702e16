"""The candidates the tuner tries for a generated GEMM or implicit-GEMM conv (``gemm:`` pieces).

Each candidate changes one thing of the piece's current decision (coordinate descent: a round
applies candidate ``label`` to every piece that has one, on top of what that piece has won so
far): a :class:`~apollo_py.codegen.gemm.Blocking` field (``mr``, ``nr``, ``kc``,
``b_block_bytes``, ``max_panels``, ``direct_a``; ``tiles_per_thread`` where this version's
Blocking has it: how finely :func:`gemm.layout` splits a matmul for the threads) or the thread
count (one thread: the calling thread runs every tile; two: the pool runs them although the
product is below ``SMALL_FLOPS``).  A candidate whose blocking and layout equal the current ones
(the change does not apply at this size) is not offered, so a round compiles only the GEMMs it
changes.  Rounds are in the order of :data:`GEMM_ROUNDS`: threads and micro-tile first, cache
blocking last, so a tight budget drops the cache blocking first.
"""
from __future__ import annotations

from dataclasses import replace

#: round labels, in the order they are tried
GEMM_ROUNDS = ("threads", "mr", "nr", "kc-", "kc+", "direct_a", "tiles-", "tiles+", "panels-", "panels+",
               "bblock-", "bblock+")


def gemm_candidates(desc, decision: dict, threads: int) -> dict[str, dict]:
    """Round label -> the decision (``{"blocking": {...}, "threads": n}``) to time for the
    generated GEMM ``desc`` whose current decision is ``decision`` ({} = defaults), compiled
    for ``threads`` threads.  Only candidates that change the compiled blocking, layout or
    thread count are returned."""
    from ..codegen.gemm import SMALL_FLOPS, default_blocking, k_blocks, layout
    from ..runtime.gemm_step import tuned_blocking
    bl0, one0 = tuned_blocking(desc, decision)
    bl = bl0 or default_blocking(desc)
    inline = one0 if one0 is not None else 2 * desc.batch * desc.m * desc.n * desc.k < SMALL_FLOPS
    if threads <= 1:
        inline = True
    lay = layout(desc, bl, 1 if inline else threads)
    fields = dict((decision or {}).get("blocking") or {})
    out: dict[str, dict] = {}

    def offer(label: str, **change):
        b = replace(bl, **change)
        if b == bl or b.nr % b.vl or b.nr < b.vl:
            return
        parts = getattr(desc, "parts", ())     # a joint product's segments start at multiples of NR
        if any(sum(p.n for p in parts[:q]) % b.nr for q in range(len(parts))):
            return
        if layout(desc, b, 1 if inline else threads) == lay and (b.vl, b.mr, b.nr) == (bl.vl, bl.mr, bl.nr):
            return      # the same tiles and code (the layout holds k blocks and direct A): nothing to time
        out[label] = {**(decision or {}), "blocking": {**fields, **change}}

    if threads > 1:
        want = 2 if inline else 1
        if not (want == 2 and 2 * desc.batch * desc.m * desc.n * desc.k < SMALL_FLOPS // 64):
            # a tiny product on the pool only wakes a thread; from 1/64 of SMALL_FLOPS on, try it
            out["threads"] = {**(decision or {}), "threads": want}
    alt_mr = {12: 8, 8: 12, 6: 4, 4: 6}.get(bl.mr)
    if alt_mr and desc.m > min(alt_mr, bl.mr):
        offer("mr", mr=alt_mr)
    if desc.n > bl.vl:
        offer("nr", nr=bl.vl if bl.nr > bl.vl else 2 * bl.vl)
    nk, kcb = k_blocks(desc.k, bl.kc)
    if kcb > 64:
        offer("kc-", kc=max(64, bl.kc // 2))
    if nk > 1:
        offer("kc+", kc=bl.kc * 2)
    a_direct = lay.direct_a
    if desc.a_view is None and not desc.a_const:
        offer("direct_a", direct_a=not a_direct)
    if not inline and hasattr(bl, "tiles_per_thread"):     # gemm3's parallel split (a matmul on > 1 thread)
        offer("tiles-", tiles_per_thread=max(1, bl.tiles_per_thread // 2))
        offer("tiles+", tiles_per_thread=bl.tiles_per_thread * 2)
    if lay.npan_a > 4:
        offer("panels-", max_panels=max(4, bl.max_panels // 2))
        offer("panels+", max_panels=bl.max_panels * 2)
    offer("bblock-", b_block_bytes=bl.b_block_bytes // 2)
    offer("bblock+", b_block_bytes=bl.b_block_bytes * 2)
    return out
