"""Generated GEMM (codegen/gemm.py) against numpy: shapes, batching, epilogues, conv."""
import numpy as np
import pytest

from apollo_py.codegen.gemm import (Blocking, EpiOperand, compile_gemm, conv_desc, matmul_desc,
                                    render_gemm)
from apollo_py.errors import CompileError
from apollo_py.ir.graph import Node
from apollo_py.ops.structural import conv_reference
from apollo_py.runtime.threadpool import ThreadPool

RTOL, ATOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def pool():
    p = ThreadPool(2)
    yield p
    p.close()


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _mm(pool, xs, ys, bl=None, seed=0):
    rng = np.random.default_rng(seed)
    x, y = _rand(rng, *xs), _rand(rng, *ys)
    want = np.matmul(x.astype(np.float64), y.astype(np.float64))
    d = matmul_desc("g", xs, ys, want.shape, "h", outputs=("h",), out_dtypes=("float32",))
    cg = compile_gemm(d, 2, bl)
    out = np.full(want.shape, np.nan, np.float32)
    cg.run(pool, x, y, [], [out])
    return out, want


@pytest.mark.parametrize("xs,ys", [
    ((64, 64), (64, 64)),            # square, multiple of nothing in particular
    ((1, 1), (1, 1)),                # smallest
    ((37, 53), (53, 29)),            # odd sizes, not multiples of the micro-tile
    ((200, 3), (3, 300)),            # tiny K
    ((5, 700), (700, 7)),            # skinny, long K
    ((13, 40, 17), (17, 45)),        # batched A, plain B (folded into rows)
    ((3, 1, 20, 17), (4, 17, 33)),   # broadcasting batch dims
    ((2, 20, 17), (17,)),            # 1-D right operand
    ((17,), (3, 17, 40)),            # 1-D left operand, batched right
    ((30,), (30,)),                  # vector dot
])
def test_matmul_shapes(pool, xs, ys):
    got, want = _mm(pool, xs, ys)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bl", [Blocking(16, 12, 32), Blocking(8, 6, 16), Blocking(16, 8, 32)])
def test_blockings(pool, bl):
    from apollo_py.codegen.llvm import host
    if bl.vl == 16 and "+avx512f" not in host().features.split(","):
        pytest.skip("no AVX-512")
    got, want = _mm(pool, (70, 130), (130, 90), bl)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_large_k_and_many_column_blocks(pool):
    # K * NC * 4 bytes caps NC: several column blocks and row groups
    got, want = _mm(pool, (150, 4100), (4100, 70))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_fused_epilogue_bias_gelu_and_two_outputs(pool):
    rng = np.random.default_rng(3)
    x, w, bias = _rand(rng, 50, 40), _rand(rng, 40, 70), _rand(rng, 70)
    nodes = (Node("add", ("h", "bias"), ("y",)), Node("mul", ("y", "half"), ("t",)),
             Node("erf", ("t",), ("e",)), Node("add", ("e", "one"), ("e1",)),
             Node("mul", ("y", "e1"), ("g",)), Node("mul", ("g", "half"), ("z",)))
    from apollo_py.codegen import loopir as L
    d = matmul_desc("g", x.shape, w.shape, (50, 70), "h", nodes=nodes,
                    operands=(EpiOperand("bias", "float32", (70,)),), outputs=("z", "h"),
                    out_dtypes=("float32", "float32"), node_dtypes=("float32",) * 6,
                    inline_consts={"half": L.Const(0.5, "float32"),
                                   "one": L.Const(1.0, "float32")})
    # t = y * 0.5 here (not y / sqrt 2): the point is the chain, not GELU's constant
    cg = compile_gemm(d, 2)
    z, h = np.empty((50, 70), np.float32), np.empty((50, 70), np.float32)
    cg.run(pool, x, w, [bias], [z, h])
    y = x.astype(np.float64) @ w + bias
    from math import erf
    want = 0.5 * y * (1 + np.vectorize(erf)(0.5 * y))
    np.testing.assert_allclose(h, x.astype(np.float64) @ w, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=2e-4)


def test_epilogue_broadcast_operands_batched(pool):
    """Operands broadcast along rows, columns, batch, and a full residual, on a batched GEMM."""
    rng = np.random.default_rng(4)
    x, y = _rand(rng, 3, 20, 30), _rand(rng, 3, 30, 40)
    col, row, bat, res = _rand(rng, 40), _rand(rng, 20, 1), _rand(rng, 3, 1, 1), _rand(rng, 3, 20, 40)
    nodes = (Node("add", ("h", "col"), ("a",)), Node("mul", ("a", "row"), ("b",)),
             Node("sub", ("b", "bat"), ("c",)), Node("max", ("c", "res"), ("z",)))
    ops = tuple(EpiOperand(n, "float32", v.shape) for n, v in
                (("col", col), ("row", row), ("bat", bat), ("res", res)))
    d = matmul_desc("g", x.shape, y.shape, (3, 20, 40), "h", nodes=nodes, operands=ops, outputs=("z",),
                    out_dtypes=("float32",), node_dtypes=("float32",) * 4)
    cg = compile_gemm(d, 2)
    z = np.empty((3, 20, 40), np.float32)
    cg.run(pool, x, y, [col, row, bat, res], [z])
    want = np.maximum((np.matmul(x.astype(np.float64), y) + col) * row - bat, res)
    np.testing.assert_allclose(z, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("xs,ws,strides,pads,dil,group", [
    ((2, 8, 13, 11), (16, 8, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((1, 6, 15, 15), (9, 2, 3, 3), (2, 2), (0, 1, 2, 0), (1, 1), 3),       # groups, asymmetric pads
    ((2, 4, 12, 10), (5, 4, 3, 2), (1, 2), (2, 2, 2, 2), (2, 3), 1),       # dilation, stride
    ((1, 8, 9, 9), (8, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 8),         # depthwise
    ((3, 5, 7, 7), (6, 5, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),         # 1x1
    ((1, 3, 5, 4), (4, 3, 3, 3), (1, 1), (3, 3, 3, 3), (1, 1), 1),         # pads wider than the kernel
    ((2, 2, 9, 7), (4, 1, 2, 3), (3, 2), (1, 0, 0, 2), (2, 1), 2),         # many rows per panel
    ((1, 4, 3, 70), (40, 4, 3, 5), (1, 3), (1, 2, 1, 2), (1, 2), 1),       # rows wider than a panel
])
def test_conv_implicit_gemm(pool, xs, ws, strides, pads, dil, group):
    rng = np.random.default_rng(5)
    x, w = _rand(rng, *xs), _rand(rng, *ws)
    want = conv_reference(x.astype(np.float64), w.astype(np.float64), strides, pads, dil, group)
    d = conv_desc("c", xs, ws, want.shape, dict(group=group, strides=strides, pads=pads, dilations=dil),
                  "h", outputs=("h",), out_dtypes=("float32",))
    cg = compile_gemm(d, 2)
    out = np.full(want.shape, np.nan, np.float32)
    cg.run(pool, w, x, [], [out])
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)


def test_render_and_bad_sizes():
    d = matmul_desc("g", (10, 20), (20, 30), (10, 30), "h", outputs=("h",), out_dtypes=("float32",))
    text = render_gemm(d)
    assert "@gemm.micro" in text and "llvm.fma" in text and "g_epi" in text
    d0 = matmul_desc("z", (10, 0), (0, 30), (10, 30), "h", outputs=("h",), out_dtypes=("float32",))
    with pytest.raises(CompileError):
        compile_gemm(d0, 2)


def test_hit_signatures_match_the_kernels():
    """A piece-cache hit binds the pack and epilogue kernels by ``_signatures`` (parameters, no
    loops): they must be the very names, parameters and parallel extents of the kernels a miss
    renders, for a matmul with epilogue operands, a batched one and a conv."""
    from dataclasses import replace

    from apollo_py.codegen import gemm as G
    ops = (EpiOperand("col", "float32", (40,)), EpiOperand("res", "float32", (3, 20, 40)))
    nodes = (Node("add", ("h", "col"), ("a",)), Node("max", ("a", "res"), ("z",)))
    descs = [matmul_desc("g", (3, 20, 30), (3, 30, 40), (3, 20, 40), "h", nodes=nodes, operands=ops,
                         outputs=("z", "h"), out_dtypes=("float32", "float32"), node_dtypes=("float32",) * 2),
             matmul_desc("g", (50, 40), (40, 70), (50, 70), "h", outputs=("h",), out_dtypes=("float32",)),
             conv_desc("c", (2, 4, 12, 10), (5, 4, 3, 2), (2, 5, 10, 5),
                       dict(group=1, strides=(1, 2), pads=(2, 2, 2, 2), dilations=(2, 3)), "h",
                       outputs=("h",), out_dtypes=("float32",))]
    for d in descs + [replace(descs[1], a_const=True, b_const=True)]:
        d = G.canonical(d)
        bl = G.default_blocking(d)
        lay = G.layout(d, bl, 2)
        real = (G._pack_a_kernel(d, bl, lay.pan_per_group), G._pack_b_kernel(d, bl, lay.nc),
                *(G._epilogue_kernel(seg, bl) for seg, _ in G.segments(d)))
        pack_a, pack_b, epis = G._signatures(d, bl, lay)
        assert len(epis) == len(real) - 2
        for got, want in zip((pack_a, pack_b, *epis), real):
            assert (got.name, got.params, got.parallel_var, got.parallel_extent) == \
                   (want.name, want.params, want.parallel_var, want.parallel_extent)


@pytest.mark.parametrize("s, heads, d, perm, bias", [
    (197, 4, 64, (2, 0, 3, 1, 4), True),     # ViT's QKV head split: runs of d = 64 stored columns
    (37, 3, 32, (2, 0, 3, 1, 4), False),     # runs of exactly NR
    (41, 2, 48, (2, 0, 3, 1, 4), False),     # runs of 48: not a multiple of NR, per-column stores
    (29, 4, 64, (3, 2, 0, 1, 4), False),     # another order, the same innermost run
])
def test_output_stored_transposed(pool, s, heads, d, perm, bias):
    """C ``[1, s, 3, heads, d]`` stored as ``transpose(C, perm)`` (a folded head split): where
    the tile's columns are consecutive in the stored layout the epilogue stores a row at once
    (codegen/gemm._col_run), and the result is numpy's either way, with an epilogue operand."""
    from dataclasses import replace
    rng = np.random.default_rng(7)
    k, n = 96, 3 * heads * d
    x, w, b = _rand(rng, s, k), _rand(rng, k, n), _rand(rng, n)
    shape = (1, s, 3, heads, d)
    kw = dict(outputs=("h",), out_dtypes=("float32",))
    if bias:
        kw = dict(nodes=(Node("add", ("h", "b"), ("y",)),), operands=(EpiOperand("b", "float32", (3, heads, d)),),
                  outputs=("y",), out_dtypes=("float32",), node_dtypes=("float32",))
    desc = replace(matmul_desc("g", (1, s, k), (k, n), shape, "h", **kw), b_const=True, out_perm=perm)
    cg = compile_gemm(desc, 2)
    out = np.full([shape[p] for p in perm], np.nan, np.float32)
    cg.inline = False
    cg.run(pool, x, w, [b.reshape(3, heads, d)] if bias else [], [out])
    want = (x.astype(np.float64) @ w + (b if bias else 0)).reshape(shape).transpose(perm)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
