"""poly/range_facts.py: exp(E - max(E)) gets the range fact upper=0 only when it is proved, and
the LLVM exp without an upper clamp it selects stays numpy-exact on the arguments it gets."""
import numpy as np
import pytest

from apollo_py.codegen import loopir as L
from apollo_py.codegen.llvm import compile_llvm, render_llvm
from apollo_py.poly.range_facts import mark_shifted_exp

N = 64
X = L.Param("x", "float32", N)
Y = L.Param("y", "float32", N)
T = L.Alloc("t", "float32", N)
I, J = L.Var("i"), L.Var("j")
M = L.Var("m", "float32")
D = L.Var("d", "float32")


def _fold(lo=0, hi=N, op="max", buf=X):
    return L.For(I, lo, hi, L.Assign("m", L.Bin(op, M, buf[I])))


def _use(lo=0, hi=N, buf=X, via="scalar", a=None, b=None):
    a = buf[J] if a is None else a
    b = M if b is None else b
    diff = L.Bin("sub", a, b)
    if via == "scalar":
        body = (L.Assign("d", diff), L.Store(Y, J, L.Un("exp", D)))
    elif via == "buffer":
        body = (L.Store(T, J, diff), L.Store(Y, J, L.Un("exp", T[J])))
    else:
        body = (L.Store(Y, J, L.Un("exp", diff)),)
    return L.For(J, lo, hi, L.Block(body))


def _exps(node) -> list:
    out = []

    def walk(x):
        if isinstance(x, L.Un) and x.op == "exp":
            out.append(x.upper)
        if isinstance(x, (L.Block,)):
            for s in x.stmts:
                walk(s)
        elif isinstance(x, L.For):
            walk(x.body)
        elif isinstance(x, (L.Assign, L.Store, L.Local)):
            walk(getattr(x, "value", getattr(x, "init", None)))
        elif isinstance(x, L.Expr):
            for f in ("a", "b", "cond", "index"):
                if isinstance(getattr(x, f, None), L.Expr):
                    walk(getattr(x, f))
    walk(node)
    return out


def _block(*stmts):
    return L.Block((T, L.Local("m", "float32", L.Const(float("-inf"), "float32")),
                    L.Local("d", "float32", L.Const(0.0, "float32")), *stmts))


@pytest.mark.parametrize("via", ["scalar", "buffer", "direct"])
def test_softmax_shape_is_marked(via):
    out = mark_shifted_exp(_block(_fold(), _use(via=via)))
    assert _exps(out) == [0.0]
    assert "<=0.0" in L.format_node(out)


@pytest.mark.parametrize("make", [
    lambda: _block(_fold(op="min"), _use()),                          # a min, not a max
    lambda: _block(_fold(), _use(b=L.Const(1.0, "float32"))),         # not the max
    lambda: _block(_fold(), _use(a=M, b=X[J])),                       # m - x >= 0
    lambda: _block(_fold(buf=Y), _use()),                             # max of another buffer
    lambda: _block(_fold(lo=8), _use()),                              # j outside the fold
    lambda: _block(_fold(hi=N - 1), _use()),
    lambda: _block(_fold(), L.Store(X, L.Const(3), L.Const(5.0, "float32")), _use()),  # x changed
    lambda: _block(_fold(), L.Assign("m", L.Const(0.0, "float32")), _use()),          # m changed
    lambda: _block(_use(), _fold()),                                  # use before the fold
    lambda: _block(_fold(), L.For(J, 0, N, L.Block((L.Store(X, J, L.Const(1.0, "float32")),
                                                    L.Store(Y, J, L.Un("exp", L.Bin("sub", X[J], M))))))),
])
def test_unproved_shapes_are_not_marked(make):
    assert _exps(mark_shifted_exp(make())) == [None]


def test_marked_kernel_matches_numpy(rng):
    """The kernel with the fact (exp without its upper clamp) against numpy, special values in
    x included (NaN row, inf, -inf, huge)."""
    body = mark_shifted_exp(_block(_fold(), _use(via="scalar")))
    assert _exps(body) == [0.0]
    k = L.Kernel("shifted_exp", (X, Y), body)
    text = render_llvm(k)
    assert "@ap.expf_nonpos" in text and "@ap.expf(" not in text
    ck = compile_llvm(k)
    cases = [rng.standard_normal(N).astype(np.float32) * 30,
             np.full(N, -1e30, np.float32), np.linspace(-300, 0, N).astype(np.float32)]
    for special in (np.nan, np.inf, -np.inf, 3e38):
        c = rng.standard_normal(N).astype(np.float32)
        c[5] = special
        cases.append(c)
    for x in cases:
        y = np.empty_like(x)
        ck([x, y])
        with np.errstate(invalid="ignore", over="ignore"):
            d = x - np.max(x)                 # float32, as the kernel rounds it
            want = np.exp(d.astype(np.float64)).astype(np.float32)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        fin = ~np.isnan(want)
        np.testing.assert_allclose(y[fin], want[fin], rtol=1e-6, atol=1e-44)


def test_fact_needs_a_float_operand():
    from apollo_py.errors import CompileError
    with pytest.raises(CompileError, match="'neg': a range fact needs a float operand"):
        L.Un("neg", L.Var("i"), 0.0)


S = L.Var("s", "float32")


def _logsoftmax_block(m_init=float("-inf"), s_init=0.0, use_lo=0, between=()):
    """The emitter's log-softmax row: m = max, t = x - m, s += exp(t), y = t - log(s)."""
    use = L.For(J, use_lo, N, L.Block((
        L.Store(T, J, L.Bin("sub", X[J], M)),
        L.Assign("d", L.Un("exp", T[J])),
        L.Assign("s", L.Bin("add", S, D)))))
    return L.Block((T, L.Local("m", "float32", L.Const(0.0, "float32")),
                    L.Local("d", "float32", L.Const(0.0, "float32")),
                    L.Local("s", "float32", L.Const(0.0, "float32")),
                    L.Local("g", "float32", L.Const(0.0, "float32")),
                    L.Assign("m", L.Const(m_init, "float32")), L.Assign("s", L.Const(s_init, "float32")),
                    _fold(), use, *between,
                    L.Assign("g", L.Un("log", S)),
                    L.For(J, 0, N, L.Store(Y, J, L.Bin("sub", T[J], L.Var("g", "float32"))))))


def _logs(node) -> list:
    return [(s.value.lower, s.value.upper) for s in node.stmts
            if isinstance(s, L.Assign) and isinstance(s.value, L.Un) and s.value.op == "log"]


def test_log_of_sum_of_shifted_exps_is_marked():
    out = mark_shifted_exp(_logsoftmax_block())
    assert _exps(out) == [0.0]
    assert _logs(out) == [(1.0, float(N))]


@pytest.mark.parametrize("kw", [dict(m_init=5.0),            # m may exceed every element
                                dict(s_init=-3.0),           # the sum does not start at 0
                                dict(use_lo=1),              # the max element may be left out
                                dict(between=(L.Assign("s", L.Const(0.5, "float32")),))])
def test_log_fact_needs_the_whole_row_from_minus_inf_and_zero(kw):
    out = mark_shifted_exp(_logsoftmax_block(**kw))
    assert _logs(out) == [(None, None)]


def test_log_fact_kernel_matches_numpy(rng):
    body = mark_shifted_exp(_logsoftmax_block())
    k = L.Kernel("logsoftmax_row", (X, Y), body)
    text = render_llvm(k)
    assert "@ap.logf_normal" in text and "@ap.logf(" not in text
    ck = compile_llvm(k)
    for special in (None, np.nan, np.inf, -np.inf, 3e38, -3e38):
        x = (rng.standard_normal(N) * 20).astype(np.float32)
        if special is not None:
            x[7] = special
        y = np.empty_like(x)
        ck([x, y])
        with np.errstate(invalid="ignore", over="ignore"):
            t = x - np.max(x)
            want = (t - np.log(np.exp(t.astype(np.float64)).sum())).astype(np.float32)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        fin = ~np.isnan(want)
        np.testing.assert_array_equal(np.isinf(y[fin]), np.isinf(want[fin]))
        ok = np.isfinite(want)
        np.testing.assert_allclose(y[ok], want[ok], rtol=1e-5, atol=1e-5)


def test_buffer_slot_is_forgotten_when_its_index_changes():
    k = L.Var("k")
    body = _block(L.Local("k", "int64", L.Const(0)), _fold(), L.For(J, 0, N, L.Block((
        L.Assign("k", J),
        L.Store(T, k, L.Bin("sub", X[J], M)),
        L.Assign("k", L.Const(N - 1)),                  # T[k] is now another element
        L.Store(Y, J, L.Un("exp", T[k]))))))
    assert _exps(mark_shifted_exp(body)) == [None]


def test_log_fact_needs_the_sum_of_this_max_shift():
    """A sum of exps shifted by the max of a wider range (m2 over x[0:N], the sum over
    x[0:N/2] with its own max m) may stay below 1: its log is not marked."""
    half = N // 2
    m2 = L.Var("m2", "float32")
    fold2 = L.For(I, 0, N, L.Assign("m2", L.Bin("max", m2, X[I])))
    use = L.For(J, 0, half, L.Block((
        L.Assign("d", L.Un("exp", L.Bin("sub", X[J], m2))),
        L.Store(Y, J, L.Un("exp", L.Bin("sub", X[J], M))),
        L.Assign("s", L.Bin("add", S, D)))))
    body = L.Block((T, L.Local("m", "float32", L.Const(0.0, "float32")),
                    L.Local("m2", "float32", L.Const(0.0, "float32")),
                    L.Local("d", "float32", L.Const(0.0, "float32")),
                    L.Local("s", "float32", L.Const(0.0, "float32")),
                    L.Local("g", "float32", L.Const(0.0, "float32")),
                    L.Assign("m", L.Const(float("-inf"), "float32")),
                    L.Assign("m2", L.Const(float("-inf"), "float32")),
                    L.Assign("s", L.Const(0.0, "float32")),
                    _fold(hi=half), fold2, use, L.Assign("g", L.Un("log", S))))
    out = mark_shifted_exp(body)
    assert _exps(out) == [0.0, 0.0]                     # both exps are <= 0 ...
    assert _logs(out) == [(None, None)]                 # ... but the sum may be < 1
