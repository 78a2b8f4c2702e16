"""The candidates the tuner tries for a generated GEMM or implicit-GEMM conv (``gemm:`` pieces).

Each candidate changes one thing of the piece's current decision (coordinate descent: a round
applies candidate ``label`` to every piece that has one, on top of what that piece has won so
far): a :class:`~apollo_py.codegen.gemm.Blocking` field (``mr``, ``nr``, ``vl``, ``kc``,
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
#: (``vl`` last: it lost on all 61 GEMM pieces it was offered on the AVX-512 box, docs/design/tuning.md)
GEMM_ROUNDS = ("threads", "mr", "nr", "kc-", "kc+", "direct_a", "tiles-", "tiles+", "panels-", "panels+",
               "bblock-", "bblock+", "nc-", "nc+", "vl")


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
    if bl.vl == 16:
        # 8-wide vectors (half a zmm: on AVX-512 hosts, 12 x 16 = 24 ymm accumulators, or one
        # ymm of columns where that pads N less, e.g. N 49: 56 columns instead of 64)
        offer("vl", vl=8, nr=8 if -(-desc.n // 8) * 8 < -(-desc.n // 16) * 16 else 16)
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



def rows_candidates(desc, decision: dict, threads: int) -> dict[str, dict]:
    """:func:`gemm_candidates` for a row-reading conv: its own layout (``rows_layout``: column
    blocks of ``nc_max`` grid columns, row groups of ``max_panels`` panels, K blocks), and no
    thread, direct-A, tile-split or B-block candidate (it always runs on the pool, reads the
    input rows in place and blocks B by ``nc_max``).  Labels: ``mr``, ``nr``, ``kc-``, ``kc+``,
    ``panels-``, ``panels+``, ``nc-``, ``nc+``, ``vl`` (a subset of :data:`GEMM_ROUNDS`)."""
    from ..codegen.conv_rows import NC_MAX, in_place, rows_blocking, rows_geom, rows_layout
    from ..codegen.gemm import k_blocks
    from ..runtime.gemm_step import tuned_blocking
    base = rows_blocking(desc)
    bl = tuned_blocking(desc, decision, base)[0] or base
    lay = rows_layout(desc, bl, threads)
    grid = rows_geom(desc.conv).grid
    fields = dict((decision or {}).get("blocking") or {})
    out: dict[str, dict] = {}

    def offer(label: str, **change):
        b = replace(bl, **change)
        if b == bl or b.nr % b.vl or b.nr < b.vl or (in_place(desc.conv) and grid < b.nr):
            return
        if rows_layout(desc, b, threads) == lay and (b.vl, b.mr, b.nr) == (bl.vl, bl.mr, bl.nr):
            return
        out[label] = {**(decision or {}), "blocking": {**fields, **change}}

    alt_mr = {12: 8, 8: 12, 6: 4, 4: 6}.get(bl.mr)
    if alt_mr and desc.m > min(alt_mr, bl.mr):
        offer("mr", mr=alt_mr)
    if grid > bl.vl:
        offer("nr", nr=bl.vl if bl.nr > bl.vl else 2 * bl.vl)
    if bl.vl == 16:
        offer("vl", vl=8, nr=8 if -(-grid // 8) * 8 < -(-grid // 16) * 16 else 16)
    nk, kcb = k_blocks(desc.k, bl.kc)
    if kcb > 64:
        offer("kc-", kc=max(64, bl.kc // 2))
    if nk > 1:
        offer("kc+", kc=bl.kc * 2)
    if lay.npan_a > 4:
        offer("panels-", max_panels=max(4, bl.max_panels // 2))
        offer("panels+", max_panels=bl.max_panels * 2)
    nc = bl.nc_max or NC_MAX
    offer("nc-", nc_max=max(bl.nr, nc // 2))
    offer("nc+", nc_max=nc * 2)
    return out
