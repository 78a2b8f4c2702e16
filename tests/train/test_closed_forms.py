"""Gradients against closed forms: matmul, softmax cross-entropy, layer normalization."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.ir import GraphBuilder
from apollo_py.runtime.reference import evaluate
from apollo_py.train.graphs import reduce_all
from apollo_py.train.losses import cross_entropy


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_matmul_closed_form(dtype, rtol):
    rng = np.random.default_rng(0)
    A, Bm, G = (rng.standard_normal(s).astype(dtype) for s in ((5, 7), (7, 3), (5, 3)))
    b = GraphBuilder()
    a, w = b.input("a", A.shape, dtype), b.input("w", Bm.shape, dtype)
    g = b.build([reduce_all(b, b.mul(b.matmul(a, w), b.constant(G)))])
    _, da, dw = evaluate(ap.grad(g, ["a", "w"]), {"a": A, "w": Bm})
    np.testing.assert_allclose(da, G @ Bm.T, rtol=rtol)
    np.testing.assert_allclose(dw, A.T @ G, rtol=rtol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_softmax_cross_entropy_closed_form(dtype):
    rng = np.random.default_rng(1)
    n, c = 6, 5
    logits = (3 * rng.standard_normal((n, c))).astype(dtype)
    labels = rng.integers(0, c, n)
    b = GraphBuilder()
    x = b.input("x", (n, c), dtype)
    y = b.input("y", (n,), "int64")
    g = b.build([cross_entropy(b, x, y)])
    loss, dx = evaluate(ap.grad(g, ["x"]), {"x": logits, "y": labels})
    e = np.exp(logits - logits.max(1, keepdims=True))
    sm = e / e.sum(1, keepdims=True)
    onehot = np.eye(c)[labels]
    tol = 1e-12 if dtype == "float64" else 1e-6
    np.testing.assert_allclose(loss, -np.mean(np.log(sm[np.arange(n), labels])), rtol=tol * 10)
    np.testing.assert_allclose(dx, (sm - onehot) / n, atol=tol)


def _layernorm_closed_form(x, gamma, g, eps):
    n = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    gx = g * gamma
    dx = rstd / n * (n * gx - gx.sum(-1, keepdims=True) - xhat * (gx * xhat).sum(-1, keepdims=True))
    return dx, (g * xhat).reshape(-1, n).sum(0), g.reshape(-1, n).sum(0)


def test_layernorm_closed_form():
    rng = np.random.default_rng(2)
    shape, eps = (3, 4, 8), 1e-5
    X = rng.standard_normal(shape)
    gam, bet, G = rng.standard_normal(8), rng.standard_normal(8), rng.standard_normal(shape)
    b = GraphBuilder()
    x = b.input("x", shape, "float64")
    gamma, beta = b.input("gamma", (8,), "float64"), b.input("beta", (8,), "float64")
    mu = b.reduce_sum(x, axes=(2,), keepdims=True) * (1 / 8)
    d = x - mu
    var = b.reduce_sum(d * d, axes=(2,), keepdims=True) * (1 / 8)
    y = d * b.rsqrt(var + eps) * gamma + beta
    g = b.build([reduce_all(b, y * b.constant(G))])
    _, dx, dg, db = evaluate(ap.grad(g, ["x", "gamma", "beta"]), {"x": X, "gamma": gam, "beta": bet})
    want = _layernorm_closed_form(X, gam, G, eps)
    for got, exp in zip((dx, dg, db), want):
        np.testing.assert_allclose(got, exp, rtol=1e-10, atol=1e-12)


def test_onnx_layernorm_decomposition_differentiates():
    """The front end's LayerNormalization decomposition is differentiable end to end."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    from apollo_py.frontend.onnx import load_onnx
    shape = (4, 6)
    node = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)
    model = helper.make_model(helper.make_graph(
        [node], "ln", [helper.make_tensor_value_info(n, TensorProto.DOUBLE, s)
                       for n, s in (("x", shape), ("gamma", (6,)), ("beta", (6,)))],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, shape)]),
        opset_imports=[helper.make_opsetid("", 17)])
    fwd = load_onnx(model).specialize({"x": shape, "gamma": (6,), "beta": (6,)})
    rng = np.random.default_rng(3)
    X, G = rng.standard_normal(shape), rng.standard_normal(shape)
    gam, bet = rng.standard_normal(6), rng.standard_normal(6)
    b = GraphBuilder()
    env = {v: b.input(v, fwd.types[v].shape, fwd.types[v].dtype) for v in fwd.inputs}
    from apollo_py.train.graphs import replay
    vals = replay(b, fwd, env)
    g = b.build([reduce_all(b, vals[fwd.outputs[0]] * b.constant(G))])
    _, dx, dg, db = evaluate(ap.grad(g, ["x", "gamma", "beta"]), {"x": X, "gamma": gam, "beta": bet})
    want = _layernorm_closed_form(X, gam, G, 1e-5)
    # ONNX LayerNormalization normalises in stash_type = float32 by default, hence float32 tolerances
    for got, exp in zip((dx, dg, db), want):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


def test_grad_api_contract():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    i = b.input("i", (2,), "int64")
    unused = b.input("u", (4,))
    y = b.relu(x) * 3.0
    g = b.build([y, b.reduce_sum(y, axes=(0, 1), keepdims=False)])
    G = ap.grad(g, ["x", "u"])
    assert G.inputs == g.inputs and len(G.outputs) == 4
    X = np.array([[1.0, -1.0, 2.0], [0.5, -3.0, 1.0]], np.float32)
    feeds = {"x": X, "i": np.zeros(2, np.int64), "u": np.ones(4, np.float32)}
    outs = evaluate(G, feeds)
    # non-scalar loss (the first output) is differentiated as its sum
    np.testing.assert_array_equal(outs[2], 3.0 * (X > 0))
    np.testing.assert_array_equal(outs[3], np.zeros(4, np.float32))
    # loss=1 picks the scalar output: d sum(3 relu(x)) / dx is the same
    np.testing.assert_array_equal(evaluate(ap.grad(g, ["x"], loss=1), feeds)[2], 3.0 * (X > 0))
    with pytest.raises(ap.InputError, match="'nope' is not an input"):
        ap.grad(g, ["nope"])
    with pytest.raises(ap.InputError, match="not a float"):
        ap.grad(g, ["i"])
    with pytest.raises(ap.InputError, match="not an output"):
        ap.grad(g, ["x"], loss="zzz")


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_stop_gradient_blocks_the_gradient(target):
    """d/dx sum(x * stop_gradient(x)) = x (not 2x); the forward value is x * x."""
    rng = np.random.default_rng(9)
    X = rng.standard_normal((4, 6)).astype(np.float32)
    b = GraphBuilder()
    x = b.input("x", X.shape)
    g = b.build([reduce_all(b, b.mul(x, b.op("stop_gradient", x)[0]))])
    loss, dx = ap.jit(ap.grad(g, ["x"]), target=target)(X)
    np.testing.assert_allclose(loss, (X.astype(np.float64) ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(dx, X, rtol=1e-6)


def test_cross_entropy_backward_has_no_max_terms():
    """The max of the stable log-softmax is a stop_gradient: with ties in the max the gradient
    is still softmax - onehot (no share of the cotangent goes to the tied maxima)."""
    n, c = 4, 3
    logits = np.array([[1, 1, 0], [2, 2, 2], [0, 5, 5], [3, 1, 2]], np.float64)
    labels = np.array([0, 1, 2, 0])
    b = GraphBuilder()
    x, y = b.input("x", (n, c), "float64"), b.input("y", (n,), "int64")
    gg = ap.grad(b.build([cross_entropy(b, x, y)]), ["x"])
    _, dx = evaluate(gg, {"x": logits, "y": labels})
    e = np.exp(logits - logits.max(1, keepdims=True))
    sm = e / e.sum(1, keepdims=True)
    np.testing.assert_allclose(dx, (sm - np.eye(c)[labels]) / n, atol=1e-12)
    backward_ops = [nd.op for nd in gg.nodes if nd.op in ("eq", "cast")]
    assert len(backward_ops) == 2, backward_ops     # only the one-hot's eq + cast, no tie mask
