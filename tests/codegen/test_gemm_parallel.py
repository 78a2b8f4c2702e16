"""The generated GEMM on several threads (codegen/gemm.py, gemm_ir.py): the calls claim tiles
from a shared counter, the parallel split makes enough tiles for the threads, and the
results match numpy whatever the number of threads, calls or concurrent callers."""
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from apollo_py.codegen.gemm import blocking_for, compile_gemm, layout, matmul_desc
from apollo_py.runtime.threadpool import ThreadPool

sys.path.insert(0, str(Path(__file__).parent))
from gemm_cases import matmul_case  # noqa: E402

RTOL = 1e-4


@pytest.fixture(scope="module")
def pools():
    ps = {n: ThreadPool(n) for n in (2, 3)}
    yield ps
    for p in ps.values():
        p.close()


def _case(xs, ys, const, epilogue, seed=0):
    d, x, y, ops, want = matmul_case(xs, ys, epilogue, seed)
    return replace(d, b_const=const), x, y, ops, want


@pytest.mark.parametrize("xs,ys,const,epilogue", [
    ((131, 517), (517, 203), True, False),       # odd sizes, weight packed once, plain output
    ((131, 517), (517, 203), False, True),       # B packed per tile, bias + relu epilogue
    ((64, 512), (512, 256), True, False),        # DLRM's MLP shape: split into small tiles
    ((3, 2, 45, 70), (3, 2, 70, 37), False, False),   # batched
])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_matches_numpy_on_any_thread_count(pools, xs, ys, const, epilogue, threads):
    d, x, y, ops, want = _case(xs, ys, const, epilogue)
    cg = compile_gemm(d, 2)
    cg.inline = False       # the pool path even for products under SMALL_FLOPS
    out = np.full(want.shape, np.nan, np.float32)
    cg.run(pools.get(threads), x, y, ops, [out])
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.sqrt(xs[-1]))


@pytest.mark.parametrize("xs,ys,epilogue", [
    ((131, 1300), (1300, 203), True),            # 6 K blocks, odd sizes, bias + relu epilogue
    ((3, 2, 45, 300), (3, 2, 300, 37), False),   # constant B per batch: next tiles in other B batches
    ((8, 17), (17, 70), False),                  # one short K block (no prefetch), one row panel
])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_constant_b_prefetch(pools, xs, ys, epilogue, prefetch, threads):
    """A constant B's next block is prefetched by the micro-kernels (``Blocking.prefetch_b``:
    the calls claim their next tile as the last K block starts; not with a single K block);
    with or without it, on one thread or two, inline or on the pool, the product is numpy's."""
    d, x, y, ops, want = _case(xs, ys, True, epilogue)
    bl = replace(blocking_for(d.m, d.n, d.k), prefetch_b=prefetch)
    cg = compile_gemm(d, threads, bl)
    assert ("llvm.prefetch" in cg.ir) == (prefetch and cg.layout.nkc > 1)
    for inline in (True, False):
        cg.inline = inline
        out = np.full(want.shape, np.nan, np.float32)
        cg.run(pools[2] if threads == 2 else None, x, y, ops, [out])
        np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.sqrt(xs[-1]))


def test_concurrent_callers_of_one_gemm(pools):
    """Each call has its own tile counter: two Python threads running the same compiled GEMM
    on one pool at once both get the whole product."""
    d, x, y, ops, want = _case((131, 517), (517, 203), True, False)
    cg = compile_gemm(d, 2)
    cg.inline = False
    outs = [np.full(want.shape, np.nan, np.float32) for _ in range(2)]

    def go(o):
        for _ in range(5):
            cg.run(pools[2], x, y, ops, [o])
    ts = [threading.Thread(target=go, args=(o,)) for o in outs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for o in outs:
        np.testing.assert_allclose(o, want, rtol=RTOL, atol=RTOL * np.sqrt(517))


def test_tiles_come_from_the_counter():
    """An empty range does nothing; one call over any non-empty range takes every tile."""
    d, x, y, ops, want = _case((131, 517), (517, 203), False, False)
    cg = compile_gemm(d, 2)
    assert cg.layout.tiles > 2
    out = np.full(want.shape, np.nan, np.float32)
    ctr = np.zeros(2, np.int64)
    cg.main([x, y, out, ctr], 1, 1)
    assert np.isnan(out).all() and ctr[0] == 0
    cg.main([x, y, out, ctr], 0, 1)
    assert ctr[0] >= cg.layout.tiles and ctr[1] == cg.layout.tiles
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.sqrt(517))


def test_parallel_split():
    """On 2 threads the BERT-size linear layer has 16 tiles, an even count; the 1-thread
    layout keeps the cache blocking's few large tiles; a product of a few MFLOP is split
    no further than ``tile_flops``; every split covers the product."""
    d = replace(matmul_desc("g", (128, 768), (768, 768), (128, 768), "h", outputs=("h",),
                            out_dtypes=("float32",)), b_const=True)
    bl = blocking_for(d.m, d.n, d.k)
    one, two = layout(d, bl, 1), layout(d, bl, 2)
    assert one.tiles <= 2 < 16 <= two.tiles and two.tiles % 2 == 0
    for lay in (one, two, layout(d, bl, 3)):
        assert lay.mg * lay.pan_per_group * bl.mr >= d.m and lay.njc * lay.nc >= d.n
        assert lay.nc % bl.nr == 0
    small = replace(d, m=64, n=64, k=256, out_shape=(64, 64))     # 2 MFLOP
    assert layout(small, bl, 2).tiles <= max(2, 2 * 64 * 64 * 256 // bl.tile_flops)
    # the field decides: fewer tiles per thread, fewer tiles
    assert layout(d, replace(bl, tiles_per_thread=2), 2).tiles < two.tiles
