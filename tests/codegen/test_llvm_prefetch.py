"""LLVM back end: software prefetch of the next rows in row loops (llvm.prefetch_plan)."""
import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen import llvm as LL
from apollo_py.codegen.llvm import compile_llvm, prefetch_plan, render_llvm
from apollo_py.codegen.loopir import Param, Store, Var

import codegen_kernels as K


def test_affine_coefficients():
    i, j = Var("i"), Var("j")
    assert L.affine_form((i * 128 + j) * 2 - 3) == {"i": 256, "j": 2, "": -3}
    assert L.affine_form(L.as_expr(7)) == {"": 7}
    assert L.affine_form(i * j) is None                      # not affine
    assert L.affine_form(L.Bin("floordiv", i, L.as_expr(2))) is None


def test_softmax_row_loop_prefetches_rows_ahead(rng):
    rows, cols = 300, 128
    k = K.softmax_rows(rows, cols)
    plan = prefetch_plan(k.body, k.params)
    # x is read twice per row (max pass, exp pass) at the same row base: one entry; this
    # kernel also reads o back (sum and scale passes), so o's rows are fetched too
    assert [(buf.name, base, row) for buf, base, row, _ in plan] == [("x", {"r": 128}, 512),
                                                                       ("o", {"r": 128}, 512)]
    assert plan[0][3] == LL.PREFETCH_AHEAD_BYTES // 512
    text = render_llvm(k)
    assert text.count("call void @llvm.prefetch.p0") == 2 * 512 // 64
    ck = compile_llvm(k)
    x = (rng.standard_normal(rows * cols) * 10).astype(np.float32)
    o = np.empty_like(x)
    ck([x, o])                 # the last rows prefetch past the end of x: harmless
    np.testing.assert_allclose(o, K.ref_softmax(x, rows, cols), rtol=2e-6, atol=1e-9)


def test_no_prefetch_for_innermost_or_wide_or_narrow_rows():
    x, o = Param("x", "float32", 1 << 20), Param("o", "float32", 1 << 20)
    i, j = Var("i"), Var("j")
    flat = K.for_("i", 0, 1 << 20, Store(o, i, x[i] * 2.0), "parallel")
    assert prefetch_plan(flat, (x, o)) == []                 # no inner loop: nothing to fetch
    for cols in (16, 8192):                                   # 64 B rows; 32 KiB rows
        nest = K.for_("i", 0, (1 << 20) // cols,
                      K.for_("j", 0, cols, Store(o, i * cols + j, x[i * cols + j]), "vector"), "parallel")
        assert prefetch_plan(nest, (x, o)) == []
        assert "llvm.prefetch" not in render_llvm(L.Kernel("k", (x, o), nest, "i", (1 << 20) // cols))
