"""The reference interpreter, and LLVM against it on random expressions (hypothesis)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apollo_py.codegen import loopir as L
from apollo_py.codegen.interp import interpret
from apollo_py.codegen.llvm import compile_llvm
from apollo_py.errors import InputError

import codegen_kernels as K


def test_interpreter_matches_numpy_on_hand_kernels(rng):
    rows, cols = 3, 40
    x = rng.standard_normal(rows * cols).astype(np.float32)
    o = np.empty_like(x)
    interpret(K.softmax_rows(rows, cols), [x, o])
    np.testing.assert_allclose(o, K.ref_softmax(x, rows, cols), rtol=1e-6)
    for form in ("x", "y", "all"):
        xr = rng.standard_normal(5 * 37).astype(np.float32)
        out = np.empty(1 if form == "all" else 5, np.float32)
        interpret(K.reduce_form(form, "sum", 5, 37), [xr, out])
        np.testing.assert_allclose(out, K.ref_reduce(form, "sum", xr, 5, 37), rtol=1e-5)
    n = 64
    a, b = rng.integers(0, 100, n), rng.integers(0, 100, n)
    m = rng.random(n) < 0.5
    outs = [np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.bool_)]
    interpret(K.int_kernel(n), [a, b, m, *outs])
    for got, want in zip(outs, K.ref_int_kernel(a, b, m)):
        np.testing.assert_array_equal(got, want)


def test_interpreter_checks_bounds():
    x = L.Param("x", "float32", 4)
    i = L.Var("i")
    k = L.Kernel("oob", (x,), L.for_("i", 0, 5, L.Store(x, i, L.Const(1.0, "float32"))))
    with pytest.raises(InputError, match="out of bounds"):
        interpret(k, [np.zeros(4, np.float32)])


def test_locals_shadowing_and_assignment():
    o = L.Param("o", "int64", 1)
    s, i = L.Var("s"), L.Var("i")
    body = L.block(L.Local("s", "int64", 0),
                   L.for_("i", 0, 5, [L.Assign("s", s + i),
                                      L.Block((L.Local("s", "int64", 100),))]),
                   L.Store(o, L.Const(0), s))
    k = L.Kernel("acc", (o,), body)
    out = np.zeros(1, np.int64)
    interpret(k, [out])
    assert out[0] == 10
    compile_llvm(k)([out2 := np.zeros(1, np.int64)])
    assert out2[0] == 10


_UNARY = ["neg", "abs", "exp", "tanh", "sigmoid", "relu", "floor", "erf"]
_BINARY = ["add", "sub", "mul", "max", "min"]


def _exprs(x, y):
    leaves = st.sampled_from([x, y, L.Const(0.5, "float32"), L.Const(-2.0, "float32")])

    def extend(children):
        return st.one_of(
            st.builds(lambda op, a: L.Un(op, a), st.sampled_from(_UNARY), children),
            st.builds(lambda op, a, b: L.Bin(op, a, b), st.sampled_from(_BINARY),
                      children, children),
            st.builds(lambda a, b, c: L.Select(L.lt(a, b), c, a), children, children,
                      children))
    return st.recursive(leaves, extend, max_leaves=6)


N = 64
_P = [L.Param("a", "float32", N), L.Param("b", "float32", N), L.Param("o", "float32", N)]
_I = L.Var("i")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
@given(_exprs(_P[0][_I], _P[1][_I]))
def test_llvm_matches_interpreter_on_random_expressions(expr):
    k = L.Kernel("rand_expr", _P, L.for_("i", 0, N, L.Store(_P[2], _I, expr), "vector"))
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(N) * 3).astype(np.float32)
    b = (rng.standard_normal(N) * 3).astype(np.float32)
    want, got = np.empty(N, np.float32), np.empty(N, np.float32)
    interpret(k, [a, b, want])
    compile_llvm(k)([a, b, got])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
