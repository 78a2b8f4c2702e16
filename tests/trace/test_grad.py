"""ap.grad / ap.value_and_grad over traced functions: gradients against central finite
differences in float64 (and jax.grad where jax is installed), one compiled graph with the
forward, and a plain-Python training loop with an in-place optimizer step."""
from functools import partial

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import InputError, TraceError

from . import models as M

P64 = M.init(1, np.float64)


def _tree_map(fn, *trees):
    t = trees[0]
    if isinstance(t, dict):
        return {k: _tree_map(fn, *(x[k] for x in trees)) for k in t}
    if isinstance(t, (list, tuple)):
        return type(t)(_tree_map(fn, *xs) for xs in zip(*trees))
    return fn(*trees)


def _leaves(t):
    if isinstance(t, dict):
        return [x for k in t for x in _leaves(t[k])]
    if isinstance(t, (list, tuple)):
        return [x for e in t for x in _leaves(e)]
    return [t]


def _directional_check(loss, params, args, grads, seed=0, eps=1e-6, rtol=1e-6):
    """<grad, d> against (loss(p + eps d) - loss(p - eps d)) / 2 eps for random directions d:
    one per parameter leaf (the others held fixed) and one over all of them at once."""
    rng = np.random.default_rng(seed)
    n = len(_leaves(params))
    for k in list(range(n)) + [None]:
        counter = iter(range(n))
        d = _tree_map(lambda p: rng.standard_normal(p.shape) if (j := next(counter)) == k or k is None
                      else np.zeros(p.shape), params)
        plus = loss(_tree_map(lambda p, e: p + eps * e, params, d), *args)
        minus = loss(_tree_map(lambda p, e: p - eps * e, params, d), *args)
        fd = (plus - minus) / (2 * eps)
        an = sum(_leaves(_tree_map(lambda g, e: float(np.sum(g * e)), grads, d)))
        # rounding of the loss itself limits the difference quotient to ~1e-16 |loss| / eps
        noise = 1e-15 * max(abs(plus), abs(minus)) / eps
        assert noise < 1e-3 * abs(fd) + 1e-9, f"finite differences too noisy to check direction {k}"
        np.testing.assert_allclose(an, fd, rtol=rtol, atol=1e-8 + noise, err_msg=f"direction {k}")


def _scalar_loss(model, n_out_shape, seed=5):
    w = np.random.default_rng(seed).standard_normal(n_out_shape)

    def loss(p, x):
        return np.sum(model(p, x) * w)
    return loss


CASES = M.CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_finite_differences_float64(name):
    model, pk, xk = CASES[name]
    x = P64[xk]
    out_shape = model(M.NumpyNN, P64[pk], x).shape
    loss_ap = _scalar_loss(partial(model, ap.nn), out_shape)
    loss_np = _scalar_loss(partial(model, M.NumpyNN), out_shape)
    vg = ap.jit(ap.value_and_grad(loss_ap))
    val, grads = vg(P64[pk], x)
    np.testing.assert_allclose(val, loss_np(P64[pk], x), rtol=1e-10)
    assert _tree_map(lambda g: g.shape, grads) == _tree_map(lambda p: p.shape, P64[pk])
    _directional_check(loss_np, P64[pk], (x,), grads)
    # forward and backward are one compiled graph: one trace, one plan with both
    assert vg.trace_count == 1
    assert len(vg.plan.kernels) > 0


def test_softmax_layernorm_chain_gradient_wrt_input_and_argnums():
    g, b = P64["transformer"]["lnf_g"], P64["transformer"]["lnf_b"]
    w = np.random.default_rng(2).standard_normal((2, 6, 16))

    def chain(nn, x, g, b):
        return np.sum(nn.log_softmax(nn.layer_norm(nn.softmax(x * 2.0), g, b)) * w)
    x = P64["x_attn"]
    grads = ap.grad(partial(chain, ap.nn), argnums=(0, 1, 2))(x, g, b)
    assert isinstance(grads, tuple) and len(grads) == 3
    _directional_check(lambda p: chain(M.NumpyNN, *p), (x, g, b), (), grads)


@pytest.mark.parametrize("name", ["layernorm", "softmax", "logsoftmax", "bias_gelu", "bias_maxpool",
                                  "bias_reducesum", "four_branches"])
def test_memory_bound_workload_gradients(name):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import workloads
    wl = workloads.build(name, quick=True)
    names = sorted(wl.inputs)
    arrays = tuple(wl.inputs[k].astype(np.float64)[:4] for k in names)

    w = np.random.default_rng(7).standard_normal(wl.numpy_fn(**dict(zip(names, arrays))).shape)

    def loss(*xs):  # linear in the output: keeps |loss| small against its derivatives
        return np.sum(wl.numpy_fn(**dict(zip(names, xs))) * w)
    grads = ap.grad(loss, argnums=tuple(range(len(names))))(*arrays)
    _directional_check(lambda p: loss(*p), arrays, (), grads, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jax_grad_agrees_where_installed(name):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    model, pk, xk = CASES[name]
    x = P64[xk]
    out_shape = model(M.NumpyNN, P64[pk], x).shape
    w = np.random.default_rng(5).standard_normal(out_shape)
    ga = ap.grad(lambda p, x: np.sum(model(ap.nn, p, x) * w))(P64[pk], x)
    jnn = M.jax_nn()
    gj = jax.grad(lambda p, x: (model(jnn, p, x) * w).sum())(P64[pk], x)
    got, want = _leaves(ga), _leaves(_tree_map(lambda _, g: np.asarray(g), ga, gj))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


def test_has_aux_closures_and_errors():
    w = P64["mlp"]["w1"]

    @ap.jit
    def step(x, scale):
        def loss(x):
            y = np.tanh(x @ w) * scale        # closes over a traced value of the outer trace
            return np.mean(y ** 2), y.max()
        (l, aux), g = ap.value_and_grad(loss, has_aux=True)(x)
        return l, aux, g
    x = P64["x_mlp"]
    scale = np.asarray(1.5)
    l, aux, g = step(x, scale)

    def ref(x):
        return np.mean((np.tanh(x @ w) * 1.5) ** 2)
    np.testing.assert_allclose(l, ref(x), rtol=1e-12)
    np.testing.assert_allclose(aux, (np.tanh(x @ w) * 1.5).max(), rtol=1e-12)
    _directional_check(ref, x, (), g)
    with pytest.raises(TraceError, match="scalar"):
        ap.grad(lambda x: x * 2)(x)
    with pytest.raises(InputError, match="float"):
        ap.grad(lambda x, i: np.sum(x[i]), argnums=1)(x, np.array([0, 1]))
    # the graph-level ap.grad is unchanged
    b = ap.GraphBuilder("g")
    a = b.input("a", (3,), "float64")
    gg = ap.grad(b.build([b.reduce_sum(b.mul(a, a), axes=(0,))]), ["a"])
    assert isinstance(gg, ap.Graph) and len(gg.outputs) == 2


@pytest.mark.parametrize("opt", [ap.optim.SGD(lr=0.1, momentum=0.9), ap.optim.Adam(lr=0.05)],
                         ids=["sgd_momentum", "adam"])
def test_plain_python_training_loop_updates_in_place(opt):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 12)).astype(np.float32)
    true_w = rng.standard_normal((12, 1)).astype(np.float32)
    Y = np.tanh(X @ true_w)
    params = {"w1": (rng.standard_normal((12, 16)) * 0.3).astype(np.float32), "b1": np.zeros(16, np.float32),
              "w2": (rng.standard_normal((16, 1)) * 0.3).astype(np.float32), "b2": np.zeros(1, np.float32)}
    arrays = {k: v for k, v in params.items()}

    def loss(p, x, y):
        return np.mean((ap.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)
    vg = ap.jit(ap.value_and_grad(loss))
    # the same steps in numpy (plain-numpy forward/backward + the optimizer's formulas)
    first = None
    for _ in range(40):
        l, g = vg(params, X, Y)
        first = l if first is None else first
        opt.apply(params, g)
    assert all(params[k] is arrays[k] for k in params)     # updated in place
    assert vg.trace_count == 1
    assert l < 0.5 * first
    with pytest.raises(InputError, match="structure"):
        opt.apply(params, {"w1": g["w1"]})


def test_one_optimizer_step_matches_numpy_adam():
    rng = np.random.default_rng(4)
    p = {"w": rng.standard_normal((5, 3)).astype(np.float64)}
    g = {"w": rng.standard_normal((5, 3)).astype(np.float64)}
    w0 = p["w"].copy()
    opt = ap.optim.Adam(lr=0.01)
    m = v = np.zeros_like(w0)
    for t in (1, 2):
        opt.apply(p, g)
        m = 0.9 * m + 0.1 * g["w"]
        v = 0.999 * v + 0.001 * g["w"] ** 2
        w0 = w0 - 0.01 / (1 - 0.9 ** t) * m / (np.sqrt(v) / np.sqrt(1 - 0.999 ** t) + 1e-8)
    np.testing.assert_allclose(p["w"], w0, rtol=1e-12)
