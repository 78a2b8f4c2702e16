"""C renderer: compiled with the system cc, it must agree with the LLVM back end and numpy.

One kernel per op class at least: elementwise (bias+GELU), broadcast, reduction (sum/max over
each axis form, softmax), window (maxpool), integer/bool, float64 math, float16 storage, and
the fused epilogue of a matmul as the CPU pipeline generates it.
"""
import numpy as np
import pytest

from apollo_py.codegen.c import compile_c, find_cc, render_c
from apollo_py.codegen.llvm import compile_llvm
from apollo_py.errors import CompileError

import codegen_kernels as K

pytestmark = pytest.mark.skipif(find_cc() is None, reason="no C compiler on PATH")


def _both(kernel, arrays_fn):
    """Run ``kernel`` through C and LLVM on fresh copies of the same inputs."""
    outs = []
    for compile_fn in (compile_c, compile_llvm):
        ck = compile_fn(kernel)
        arrays = arrays_fn()
        ck(arrays)
        outs.append(arrays)
    return outs


def test_source_has_abi_and_restrict():
    src = render_c(K.broadcast_add_mul(4, 8))
    assert "void bcast_add_mul(void **args, int64_t lo, int64_t hi)" in src
    assert "float *restrict a = (float *)args[0];" in src


def test_elementwise_gelu_agrees(rng):
    m, n = 16, 200
    x = (rng.standard_normal(m * n) * 3).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c_out, l_out = _both(K.bias_gelu(m, n), lambda: [x, b, np.empty_like(x)])
    np.testing.assert_allclose(c_out[2], l_out[2], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(c_out[2], K.ref_gelu_tanh((x.reshape(m, n) + b).ravel()),
                               rtol=2e-6, atol=1e-6)


def test_broadcast_agrees(rng):
    m, n = 9, 33
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in (m * n, n, m))
    c_out, l_out = _both(K.broadcast_add_mul(m, n), lambda: [a, b, c, np.empty(m * n, np.float32)])
    np.testing.assert_allclose(c_out[3], l_out[3], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(c_out[3], K.ref_broadcast_add_mul(a, b, c, m, n).ravel(), rtol=1e-6, atol=1e-6)


def test_softmax_agrees(rng):
    rows, cols = 20, 128
    x = (rng.standard_normal(rows * cols) * 5).astype(np.float32)
    c_out, l_out = _both(K.softmax_rows(rows, cols), lambda: [x, np.empty_like(x)])
    np.testing.assert_allclose(c_out[1], l_out[1], rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(c_out[1], K.ref_softmax(x, rows, cols).ravel(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("form", ["all", "x", "y"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_agrees(form, op, rng):
    # same IR and order of float ops; only FMA contraction (LLVM) may differ in the last bit
    p, r = 7, 150
    x = rng.standard_normal(p * r).astype(np.float32)
    n_out = 1 if form == "all" else p
    c_out, l_out = _both(K.reduce_form(form, op, p, r),
                         lambda: [x, np.empty(n_out, np.float32)])
    np.testing.assert_allclose(c_out[1], l_out[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(c_out[1], K.ref_reduce(form, op, x, p, r), rtol=1e-5, atol=1e-4)


def test_maxpool_agrees(rng):
    ch, h, w = 2, 8, 12
    x = rng.standard_normal(ch * h * w).astype(np.float32)
    b = rng.standard_normal(ch).astype(np.float32)
    n_out = ch * (h // 2) * (w // 2)
    c_out, l_out = _both(K.bias_maxpool(ch, h, w), lambda: [x, b, np.empty(n_out, np.float32)])
    np.testing.assert_array_equal(c_out[2], l_out[2])
    np.testing.assert_array_equal(c_out[2], K.ref_bias_maxpool(x, b, ch, h, w))


def test_int_bool_agrees(rng):
    n = 300
    a = rng.integers(0, 100, n).astype(np.int64)
    b = rng.integers(0, 100, n).astype(np.int64)
    m = rng.random(n) < 0.5

    def arrays():
        return [a, b, m, np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.bool_)]
    c_out, l_out = _both(K.int_kernel(n), arrays)
    for k, want in zip((3, 4, 5), K.ref_int_kernel(a, b, m)):
        np.testing.assert_array_equal(c_out[k], l_out[k])
        np.testing.assert_array_equal(c_out[k], want)


def test_float64_agrees(rng):
    n = 500
    x = rng.standard_normal(n) * 4
    c_out, l_out = _both(K.float64_kernel(n), lambda: [x, np.empty(6 * n)])
    np.testing.assert_allclose(c_out[1], l_out[1], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(c_out[1], K.ref_float64(x), rtol=1e-12, atol=1e-15)


def test_fused_matmul_epilogue_agrees(rng):
    """The epilogue kernel layer 1 fuses after a matmul (scale, bias, relu) in C, LLVM, numpy."""
    import apollo_py as ap
    from apollo_py.ir import GraphBuilder
    b = GraphBuilder()
    x, w = b.input("x", (24, 40)), b.input("w", (40, 56))
    bv = rng.standard_normal(56).astype(np.float32)
    g = b.build([b.relu(b.matmul(x, w) * 0.5 + b.constant(bv))])
    f = ap.jit(g, target="cpu")
    kernels = [k.fused for k in f.plan.kernels if k.fused is not None]
    assert len(kernels) == 1, "the matmul epilogue should be one generated kernel"
    (fk,) = kernels
    pg = f.plan.graph
    consts = {n.outputs[0]: np.asarray(n.attrs["value"].array) for n in pg.nodes if n.op == "constant"}
    xv = rng.standard_normal((24, 40)).astype(np.float32)
    wv = rng.standard_normal((40, 56)).astype(np.float32)
    mm = xv @ wv

    def arrays():
        out = []
        for v in fk.param_values:
            t = pg.types[v]
            if v in fk.outputs:
                out.append(np.empty(t.shape, t.np_dtype))
            elif v in consts:
                out.append(np.ascontiguousarray(consts[v], dtype=t.np_dtype))
            else:  # the one computed input is the matmul's result
                assert t.shape == mm.shape, (v, t)
                out.append(mm.copy())
        return out
    c_out, l_out = _both(fk.loop, arrays)
    k = list(fk.param_values).index(fk.outputs[-1])
    np.testing.assert_allclose(c_out[k], l_out[k], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(c_out[k], np.maximum(mm * 0.5 + bv, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c_out[k], f(xv, wv), rtol=1e-5, atol=1e-5)


def test_parallel_chunk_in_c(rng):
    m, n = 6, 16
    ck = compile_c(K.bias_gelu(m, n))
    x = rng.standard_normal(m * n).astype(np.float32)
    o = np.full(m * n, -3.0, np.float32)
    ck([x, np.zeros(n, np.float32), o], lo=2, hi=4)
    rows = o.reshape(m, n)
    assert (rows[:2] == -3).all() and (rows[4:] == -3).all() and (rows[2:4] != -3).all()


def test_float16_storage_agrees(rng):
    m, n = 4, 32
    x = rng.standard_normal(m * n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    try:
        c_out, l_out = _both(K.bias_gelu(m, n, "float16"), lambda: [x, b, np.empty_like(x)])
    except CompileError as exc:  # the C compiler may lack _Float16
        pytest.skip(f"C compiler without _Float16: {exc}")
    np.testing.assert_allclose(c_out[2].astype(np.float32), l_out[2].astype(np.float32),
                               rtol=1e-3, atol=1e-3)


def _softmax_ref(x):
    x = x.reshape(5, 128).astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).ravel()


@pytest.mark.parametrize("build,arrays,want", [
    (lambda: K.softmax_rows(5, 128),
     lambda r: [r.standard_normal(640).astype(np.float32), np.empty(640, np.float32)], _softmax_ref),
    (lambda: K.reduce_form("y", "max", 19, 133),
     lambda r: [r.standard_normal(19 * 133).astype(np.float32), np.empty(19, np.float32)],
     lambda x: K.ref_reduce("y", "max", x, 19, 133)),
    (lambda: K.reduce_form("x", "sum", 7, 45),
     lambda r: [r.standard_normal(7 * 45).astype(np.float32), np.empty(7, np.float32)],
     lambda x: K.ref_reduce("x", "sum", x, 7, 45)),
])
def test_ubsan_clean(build, arrays, want, rng):
    # UBSan with bounds checks on the Alloc tiles; any report aborts the process.  The output
    # is checked too: a kernel that ran clean but computed nothing must not pass
    flags = ("-O1", "-fsanitize=undefined,bounds", "-fno-sanitize-recover=all")
    try:
        ck = compile_c(build(), flags=flags)
    except CompileError as exc:
        pytest.skip(f"C compiler without UBSan: {exc}")
    args = arrays(rng)
    args[1][:] = np.nan
    ck(args)
    np.testing.assert_allclose(args[1], want(args[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "uint16", "uint32", "uint64"])
def test_small_and_unsigned_ints_agree(dtype, rng):
    """Wrapping add/mul, unsigned compares, max and casts: C, LLVM and numpy."""
    from apollo_py.codegen import loopir as L
    n = 257
    a, b = L.Param("a", dtype, n), L.Param("b", dtype, n)
    o, of = L.Param("o", dtype, n), L.Param("of", "float32", n)
    i = L.Var("i")
    s = a[i] + b[i]
    body = L.for_("i", 0, n, [L.Store(o, i, L.Select(L.gt(s, b[i]), L.maximum(s, a[i]), b[i] * 3)),
                              L.Store(of, i, L.Cast("float32", a[i]))], "parallel")
    k = L.Kernel(f"ints_{dtype}", (a, b, o, of), body, "i", n)
    info = np.iinfo(dtype)
    av = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    bv = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    c_out, l_out = _both(k, lambda: [av, bv, np.empty(n, dtype), np.empty(n, np.float32)])
    with np.errstate(over="ignore"):
        sv = av + bv
        want = np.where(sv > bv, np.maximum(sv, av), bv * np.array(3, dtype))
    for got in (c_out, l_out):
        np.testing.assert_array_equal(got[2], want)
        np.testing.assert_array_equal(got[3], av.astype(np.float32))
