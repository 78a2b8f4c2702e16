"""Tracing numpy-style functions with ap.jit: semantics against plain numpy, signatures,
retracing, pytrees and the errors a user meets."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import InputError, TraceError, UnsupportedOpError

RNG = np.random.default_rng(0)
X = RNG.standard_normal((6, 8)).astype(np.float32)
Y = RNG.standard_normal((6, 8)).astype(np.float32)
REF = ap.Options(target="reference")


def check(got, want, rtol=1e-5, atol=1e-6):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


OPS = {
    "arith": lambda x, y: (x + y) * 2 - y / 3 + 1.5,
    "pow_abs": lambda x, y: np.abs(x) ** 1.5 + x ** 2,
    "unary": lambda x, y: np.exp(np.tanh(x)) + np.log1p(np.abs(y)) + np.sqrt(np.abs(x)) - np.square(y),
    "compare_where": lambda x, y: np.where((x > y) & (y < 0.5), x, -y),
    "reductions": lambda x, y: (x.sum(0), x.mean(axis=1, keepdims=True), np.max(y, axis=(0, 1)),
                                y.min(-1), x.var(1), np.std(y), np.prod(x[:2, :3], axis=0)),
    "arg": lambda x, y: (np.argmax(x, axis=1), x.argmin()),
    "bool_reduce": lambda x, y: (np.any(x > 2, axis=0), (y > -3).all()),
    "shape_ops": lambda x, y: (x.T, x.reshape(4, 12), x.reshape(-1, 2).transpose(1, 0), np.swapaxes(x[None], 0, 2),
                               np.expand_dims(x, 1), np.squeeze(x[:, None, :1]), x.flatten(), np.moveaxis(x.reshape(2, 3, 8), 0, -1)),
    "index": lambda x, y: (x[1], x[:, 2], x[1:5:2, ::-3], x[..., -1], x[None, 2:, None, 1],
                           x[np.array([0, 3, 3])], x[:, [1, 0]], x[np.array([True, False, True, False, False, True])]),
    "matmul": lambda x, y: (x @ y.T, np.dot(x, y.T), np.matmul(x.reshape(2, 3, 8), y.T)),
    "einsum": lambda x, y: (np.einsum("ij,kj->ik", x, y), np.einsum("ij->j", x)),
    "concat_stack": lambda x, y: (np.concatenate([x, y], axis=1), np.stack([x, y], -1), np.hstack([x, y]),
                                  np.vstack([x, y])),
    "pad": lambda x, y: (np.pad(x, ((1, 2), (0, 3))), np.pad(x, 1, mode="edge"),
                         np.pad(x, (2, 1), mode="reflect"), np.pad(x, ((0, 0), (1, 1)), constant_values=-2.0)),
    "misc": lambda x, y: (np.clip(x, -0.5, 0.5), np.maximum(x, 0), np.minimum(x, y), np.broadcast_to(x[:1], (3, 8)),
                          np.zeros_like(x) + 1, np.ones_like(y) * x, np.cumsum(x, axis=1), np.tril(x), np.triu(x, 1),
                          np.round(x * 4), np.sign(y), np.floor(x) + np.ceil(y), np.tile(x[:2, :2], (2, 3))),
    "split": lambda x, y: tuple(np.split(x, 2, axis=0)) + tuple(np.array_split(y, [3, 5], axis=1)),
    "int_math": lambda x, y: ((x * 10).astype(np.int32) // 3, (x * 10).astype(np.int64) % 4,
                              (x * 10).astype(np.int32) / 4, x.astype(np.int64).sum()),
    "dtype_promotion": lambda x, y: (x + np.float64(1.0), x * np.arange(8), x.astype(np.float16) + 1,
                                     (x > 0).sum(), x + np.ones(8, np.float32)),
    "iterate": lambda x, y: sum(row for row in x[:3]),
    "ufunc_reduce": lambda x, y: (np.add.reduce(x, axis=1), np.maximum.reduce(y)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_ops_match_numpy(name):
    fn = OPS[name]
    f = ap.jit(fn, options=REF)
    got, want = f(X, Y), fn(X, Y)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        check(g, w, rtol=1e-5, atol=1e-5)


def test_compiled_cpu_matches_numpy_and_retraces_only_on_new_signatures():
    def f(x, w, b):
        h = np.maximum(x @ w + b, 0.0)
        e = np.exp(h - h.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    w = RNG.standard_normal((8, 5)).astype(np.float32)
    b = RNG.standard_normal(5).astype(np.float32)
    jf = ap.jit(f)
    check(jf(X, w, b), f(X, w, b))
    check(jf(Y, w, b), f(Y, w, b))               # same signature: no new trace
    assert jf.trace_count == 1
    x2 = RNG.standard_normal((3, 8)).astype(np.float32)
    check(jf(x2, w, b), f(x2, w, b))              # new shape: a second trace
    assert jf.trace_count == 2
    check(jf(X.astype(np.float64), w.astype(np.float64), b.astype(np.float64)),
          f(X.astype(np.float64), w.astype(np.float64), b.astype(np.float64)))
    assert jf.trace_count == 3                    # new dtype
    jf(X, w, b)
    assert jf.trace_count == 3
    assert "micro-graphs" in str(jf.plan)
    assert jf.explain() is jf.plan or str(jf.explain()) == str(jf.plan)
    g = jf.lower(X, w, b)
    assert isinstance(g, ap.Graph) and [n.op for n in g.nodes].count("matmul") == 1


def test_static_arguments_and_python_scalars_are_part_of_the_signature():
    @ap.jit(static_argnames=("axis", "mode"), options=REF)
    def f(x, axis, mode="sum", scale=2.0):
        r = x.sum(axis=axis) if mode == "sum" else x.max(axis=axis)
        return r * scale
    check(f(X, 0), X.sum(0) * 2)
    check(f(X, 1, mode="max"), X.max(1) * 2)
    check(f(X, 1, mode="max", scale=3.0), X.max(1) * 3)
    assert f.trace_count == 3
    f(X, 0)
    assert f.trace_count == 3
    g = ap.jit(lambda x, n: x * n, static_argnums=1, options=REF)
    check(g(X, 4), X * 4)
    with pytest.raises(InputError, match="hashable"):
        g(X, [1])


def test_pytrees_in_and_out():
    @ap.jit(options=REF)
    def f(params, xs):
        h = xs[0] @ params["w"] + params["b"]
        return {"h": h, "pair": (h.sum(), [xs[1] * 2, None])}
    p = {"w": RNG.standard_normal((8, 3)).astype(np.float32), "b": np.ones(3, np.float32)}
    out = f(p, (X, Y))
    check(out["h"], X @ p["w"] + p["b"])
    check(out["pair"][0], (X @ p["w"] + p["b"]).sum(), rtol=1e-4)
    check(out["pair"][1][0], Y * 2)
    assert out["pair"][1][1] is None


def test_outputs_that_alias_inputs_or_each_other_and_constants():
    f = ap.jit(lambda x: (x, x, np.float32(3.0), x * 1), options=REF)
    a, b, c, d = f(X)
    check(a, X), check(b, X), check(c, np.float32(3.0)), check(d, X)
    assert a is not b


def test_closure_constants_are_baked_in():
    w = RNG.standard_normal((8, 2)).astype(np.float32)
    f = ap.jit(lambda x: x @ w, options=REF)
    check(f(X), X @ w)


def test_nested_jit_inlines():
    inner = ap.jit(lambda x: np.tanh(x) * 2)
    outer = ap.jit(lambda x: inner(x) + 1, options=REF)
    check(outer(X), np.tanh(X) * 2 + 1)
    assert inner.trace_count == 0


def test_python_branch_on_a_traced_value_names_the_line():
    def f(x):
        if x.sum() > 0:   # data-dependent: cannot be traced
            return x
        return -x
    with pytest.raises(TraceError) as e:
        ap.jit(f, options=REF)(X)
    msg = str(e.value)
    assert "test_tracing.py:" in msg and "ap.cond" in msg and "np.where" in msg
    line = int(msg.split("test_tracing.py:")[1].split(":")[0])
    import inspect
    src, start = inspect.getsourcelines(f)
    assert src[line - start].strip().startswith("if x.sum() > 0")


@pytest.mark.parametrize("fn, what", [
    (lambda x: float(x[0, 0]), "Python float"),
    (lambda x: np.asarray(x), "numpy array"),
    (lambda x: x.item(), ".item()"),
])
def test_concretisation_errors(fn, what):
    with pytest.raises(TraceError, match=what.replace("(", r"\(").replace(")", r"\)")):
        ap.jit(fn, options=REF)(X)


def test_unsupported_numpy_function_is_named():
    with pytest.raises(UnsupportedOpError, match="numpy.sort"):
        ap.jit(lambda x: np.sort(x), options=REF)(X)
    with pytest.raises(UnsupportedOpError, match="numpy.sin"):
        ap.jit(lambda x: np.sin(x), options=REF)(X)
    with pytest.raises(UnsupportedOpError, match="fft"):
        ap.jit(lambda x: np.fft.fft(x), options=REF)(X)


def test_in_place_updates_and_escaped_tracers_are_errors():
    def setitem(x):
        x[0] = 1.0
        return x
    with pytest.raises(TraceError, match="immutable"):
        ap.jit(setitem, options=REF)(X)
    with pytest.raises(TraceError, match="out="):
        ap.jit(lambda x: np.add(x, 1, out=x), options=REF)(X)
    leaked = []
    ap.jit(lambda x: leaked.append(x) or x * 2, options=REF)(X)
    with pytest.raises(TraceError, match="after its trace ended"):
        leaked[0] + 1
    with pytest.raises(TraceError, match="boolean mask"):
        ap.jit(lambda x: x[x > 0], options=REF)(X)


def test_bad_arguments():
    with pytest.raises(InputError, match="neither an array"):
        ap.jit(lambda x: x, options=REF)(object())
    with pytest.raises(InputError, match="static_argnames"):
        ap.jit(lambda x: x, static_argnames=("nope",))


def test_cond_and_fori_loop():
    @ap.jit
    def f(x, y):
        r = ap.cond(x.sum() > 0, lambda a: a * 2 + y, lambda a: a - y, x)
        return ap.fori_loop(1, 4, lambda i, v: v * 0.5 + i, r)

    def ref(x, y):
        r = x * 2 + y if x.sum() > 0 else x - y
        for i in range(1, 4):
            r = r * 0.5 + i
        return r
    for x in (X, -X):
        check(f(x, Y), ref(x, Y))
    assert f.trace_count == 1
    assert "If" in str(f.plan) and "Loop" in str(f.plan)
    # concrete predicate / no trace: plain Python
    assert ap.cond(True, lambda a: a + 1, lambda a: a - 1, 1) == 2
    assert ap.fori_loop(0, 3, lambda i, v: v + i, 0) == 3
    with pytest.raises(TraceError, match="same structure"):
        ap.jit(lambda x: ap.cond(x.sum() > 0, lambda a: a, lambda a: a[:2], x), options=REF)(X)
