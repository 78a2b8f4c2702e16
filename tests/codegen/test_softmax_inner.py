"""The softmax / log-softmax inner loops (issue #5): exp through lrint + ldexp on AVX-512, the
lane sums folded as a halving tree.  Fused kernels against numpy, special values included:
a NaN anywhere in a row makes the whole row NaN, +inf rows give NaN (inf - inf), -inf
elements give 0 (softmax) / -inf (log-softmax), as numpy's formulas do."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import apollo_py as ap
from apollo_py.codegen import llvm_math
from apollo_py.codegen.llvm import host
from apollo_py.poly.ast_to_loopir import _fold_lanes
from apollo_py.codegen import loopir as L


def _model(op: str, shape) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], axis=-1)
    graph = helper.make_graph([node], op.lower(),
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rows(rng, rows: int, cols: int) -> np.ndarray:
    x = (rng.standard_normal((rows, cols)) * 4.0).astype(np.float32)
    x[1, 5] = np.nan                    # one NaN: the whole row is NaN
    x[2, :] = np.nan
    x[3, 7] = np.inf                    # inf - inf = NaN, as numpy
    x[4, ::3] = -np.inf                 # exp(-inf) = 0
    x[5, :] = -np.inf                   # max is -inf: NaN row, as numpy
    x[6, :] = 80.0 + rng.uniform(0, 20, cols).astype(np.float32)   # large, no overflow
    x[7, :] = rng.uniform(-300, 0, cols).astype(np.float32)        # exp underflows for most
    x[8, 0] = 3.0e38
    x[9, :] = 0.0
    x[10, 9] = -np.nan
    x[11, :] = -1.0e30
    return x


def _softmax_np(x):
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def _logsoftmax_np(x):
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = x - x.max(axis=-1, keepdims=True)
        return s - np.log(np.exp(s).sum(axis=-1, keepdims=True))


def _check(got, want, rtol):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf])
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=1e-37)


@pytest.mark.parametrize("cols", [128, 100, 1000])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_fused_softmax_special_rows(op, cols):
    rng = np.random.default_rng(cols)
    x = _rows(rng, 16, cols)
    f = ap.jit(_model(op, list(x.shape)), target="cpu")
    (got,) = f.run(x=x)
    want = (_softmax_np if op == "Softmax" else _logsoftmax_np)(x.astype(np.float64))
    # log-softmax: s - log(sum) cancels for the largest element; compare with an atol there
    if op == "Softmax":
        _check(got, want, rtol=2e-6)
    else:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        inf = np.isinf(want)
        np.testing.assert_array_equal(got[inf], want[inf])
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=2e-6, atol=2e-6)


def test_exp_on_avx512_uses_lrint_without_nan_select():
    text = llvm_math.render_helpers(["expf"], scalef=True)
    assert "@llvm.lrint.i32.f32" in text and "@llvm.ldexp.f32.i32" in text
    assert "fptosi" not in text and "fcmp uno" not in text and "@llvm.rint" not in text
    plain = llvm_math.render_helpers(["expf"], scalef=False)
    assert "fptosi" in plain and "fcmp uno" in plain and "lrint" not in plain
    if "+avx512f" not in host().features.split(","):
        pytest.skip("no AVX-512 on this host: the lrint path is not compiled here")
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e10, -1e10, 3.0e38, -3.0e38, 88.8, -104.0,
                  -103.9, -87.5, 0.0, -0.0, 1e-30], np.float32)
    from apollo_py.codegen.llvm import compile_llvm
    import codegen_kernels as K
    ck = compile_llvm(K.unary_kernel("exp", x.size))
    out = np.empty_like(x)
    ck([x, out])
    assert "vcvtps2dq" in ck.asm and "vscalefps" in ck.asm
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    fin = ~np.isnan(want)
    np.testing.assert_allclose(out[fin], want[fin], rtol=1e-6, atol=1e-44)


@pytest.mark.parametrize("op,width", [("add", 16), ("mul", 8), ("add", 12)])
def test_fold_lanes_tree_order(op, width):
    """With ``tree`` the lanes fold as a halving tree (power-of-two widths), else in order."""
    a = L.Alloc("lanes", "float32", width)
    lane = L.Var("l")
    stmts = _fold_lanes("s", op, "float32", a, lane, width, "unroll", tree=True)
    vals = np.random.default_rng(5).uniform(0.5, 1.5, width).astype(np.float32)
    buf = vals.copy()
    fn = np.add if op == "add" else np.multiply
    env = {}
    for st in stmts:            # interpret the two statement shapes _fold_lanes emits
        if isinstance(st, L.For):
            hi = st.hi.value
            for lv in range(st.lo.value, hi):
                body = st.body
                if isinstance(body, L.Store):
                    h = body.value.b.index.b.value
                    buf[lv] = fn(buf[lv], buf[lv + h])
                else:
                    env["s"] = fn(env["s"], buf[lv])
        else:
            env["s"] = buf[0]
    if width & (width - 1) == 0:
        want = vals.copy()
        h = width // 2
        while h:
            want[:h] = fn(want[:h], want[h:2 * h])
            h //= 2
        assert len(stmts) == int(np.log2(width)) + 1
        assert env["s"] == want[0]
    else:
        want = vals[0]
        for v in vals[1:]:
            want = fn(want, v)
        assert env["s"] == want


@pytest.mark.parametrize("n,count", [(128, 8), (64, 4), (32, 2), (16, None), (136, None), (3072, None)])
def test_short_vector_loops_are_interleaved_to_straight_line(n, count):
    """A vector loop of 32..128 iterations (multiple of 16) carries interleave.count n/16;
    its results match numpy (a row loop with a tail of other lengths is left as it was)."""
    from apollo_py.codegen.llvm import compile_llvm, render_llvm
    import codegen_kernels as K
    k = K.unary_kernel("abs", n)
    text = render_llvm(k)
    if count is None:
        assert "llvm.loop.interleave.count" not in text
    else:
        assert f'!"llvm.loop.interleave.count", i32 {count}}}' in text
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    compile_llvm(k)([x, out])
    np.testing.assert_array_equal(out, np.abs(x))
