"""Blockings and paths of the generated GEMM (codegen/gemm.py) against numpy: A read direct
or packed, full tiles written into the output or through the scratch and the epilogue, a
partial row panel, several K and column blocks, one-vector NR, explicit Blocking fields."""
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from apollo_py.codegen.gemm import (Blocking, blocking_for, compile_gemm, layout, matmul_desc, plain_output,
                                    render_gemm)
from apollo_py.runtime.threadpool import ThreadPool

sys.path.insert(0, str(Path(__file__).parent))
from gemm_cases import matmul_case  # noqa: E402

RTOL = 1e-4


@pytest.fixture(scope="module")
def pool():
    p = ThreadPool(2)
    yield p
    p.close()


def _check(pool, xs, ys, bl_kw, epilogue=False, seed=0):
    # with the epilogue (bias + relu) not a plain product: every tile goes through the epilogue
    d, x, y, ops, want = matmul_case(xs, ys, epilogue, seed)
    assert plain_output(d) is not epilogue
    bl = replace(blocking_for(d.m, d.n), **bl_kw)
    cg = compile_gemm(d, 2, bl)
    out = np.full(want.shape, np.nan, np.float32)
    cg.run(pool, x, y, ops, [out])
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=RTOL * np.sqrt(xs[-1]))
    return cg


@pytest.mark.parametrize("xs,ys,bl_kw", [
    ((37, 600), (600, 70), {}),                      # partial row panel + columns, 3 K blocks, direct A
    ((37, 600), (600, 70), {"direct_a": False}),     # the same through the packed A
    ((37, 600), (600, 70), {"vl": 8, "mr": 6, "nr": 16}),    # the AVX2 blocking
    ((37, 600), (600, 49), {"vl": 8, "mr": 12, "nr": 16}),   # 8-wide vectors, 2 per row (the tuner's vl)
    ((3, 30, 70), (3, 70, 49), {"vl": 8, "nr": 8, "direct_a": False}),   # one 8-wide vector per row
    ((48, 600), (600, 64), {}),                      # every tile full: the output accumulates K blocks
    ((5, 9, 64), (5, 64, 9), {}),                    # batched, N fits one vector: NR = VL
    ((30, 50), (50, 20), {"kc": 16}),                # many short K blocks
    ((40, 64), (64, 300), {"b_block_bytes": 64 * 64 * 4}),   # several column blocks
    ((2, 3, 25, 40), (2, 3, 40, 33), {"max_panels": 1}),     # one panel per row group
])
@pytest.mark.parametrize("epilogue", [False, True])
def test_paths_match_numpy(pool, xs, ys, bl_kw, epilogue):
    _check(pool, xs, ys, bl_kw, epilogue)


def test_blocking_rules():
    bl = blocking_for(100, 1000)
    assert blocking_for(9, 9).nr == bl.vl and blocking_for(9, bl.vl + 1).nr == bl.nr
    if bl.vl == 16:     # AVX-512: an A read in place with a long K gets 8-row panels
        assert blocking_for(120, 1000, 3072).mr == 8 and blocking_for(120, 1000, 64).mr == 12
    # column blocks as even as the B block allows: 768 columns at KC 256 are 2 x 384 (AVX-512)
    blocks = -(-768 // bl.nc(256, 768))
    assert bl.nc(256, 768) * blocks - 768 < bl.nr * blocks
    d = matmul_desc("g", (66, 300), (300, 50), (66, 50), "h", outputs=("h",), out_dtypes=("float32",))
    lay = layout(d, replace(bl, kc=64), 2)
    assert (lay.nkc, lay.kcb) == (5, 60) and lay.direct_a
    assert not layout(replace(d, a_const=True), bl, 2).direct_a
    text = render_gemm(d)
    assert "gemm.micro_dc" in text and (("gemm.micro_r" in text) == (66 % blocking_for(66, 50).mr != 0))


def test_blocking_is_part_of_the_compiled_key(pool):
    """Two KC values of one descriptor are two kernels (a shared engine would read a B packed
    for the other KC)."""
    a = _check(pool, (20, 500), (500, 40), {"kc": 500})
    b = _check(pool, (20, 500), (500, 40), {"kc": 100})
    assert a.layout.nkc == 1 and b.layout.nkc == 5 and a.engine is not b.engine


def test_narrow_vectors_claim_only_their_alignment():
    """Packed B rows and scratch-tile rows are NR floats apart and vector v starts VL floats in:
    an 8-wide blocking's loads and stores may claim 32 bytes, not 64 (undefined behaviour)."""
    from apollo_py.codegen.gemm_ir import _micro_ir
    wide = _micro_ir(Blocking(16, 12, 32))
    narrow = _micro_ir(Blocking(8, 12, 16))
    assert "<16 x float>, ptr %bp1, align 64" in wide and "align 32" not in wide
    assert "<8 x float>, ptr %bp1, align 32" in narrow and "align 64" not in narrow


@pytest.mark.parametrize("nr", [8, 16])
def test_implicit_gemm_conv_with_8_wide_vectors(pool, nr):
    """The tuner's ``vl`` candidate on a conv (im2col packed into 8- or 16-column panels)."""
    from apollo_py.codegen.gemm import conv_desc
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 16, 7, 7)).astype(np.float32), rng.standard_normal((24, 16, 3, 3)).astype(np.float32)
    ref = np.zeros((1, 24, 7, 7), np.float64)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    for i in range(3):
        for j in range(3):
            ref += np.einsum("oc,nchw->nohw", w[:, :, i, j].astype(np.float64), xp[:, :, i:i + 7, j:j + 7])
    d = conv_desc("c", x.shape, w.shape, ref.shape, dict(group=1, strides=(1, 1), pads=(1, 1, 1, 1),
                                                         dilations=(1, 1)), "h", outputs=("h",), out_dtypes=("float32",))
    cg = compile_gemm(d, 2, Blocking(8, 12, nr))
    out = np.full(ref.shape, np.nan, np.float32)
    cg.run(pool, w, x, [], [out])
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=RTOL * 12)
