"""Finite-difference gradient checking for the autodiff tests."""
from __future__ import annotations

import numpy as np

from apollo_py.ir import GraphBuilder
from apollo_py.runtime.reference import evaluate
from apollo_py.train import grad
from apollo_py.train.graphs import reduce_all


def check_vjp(build, arrays, wrt=None, rng=None, eps=1e-6, rtol=1e-5, atol=1e-7):
    """Compare grad(sum(build(*inputs) * R)) with central differences in float64.

    ``arrays``: list of input arrays (float64 ones are differentiated unless ``wrt`` lists the
    positions); ``build(b, *values)`` returns one builder value.
    """
    rng = rng or np.random.default_rng(0)
    arrays = [np.array(a) for a in arrays]
    b = GraphBuilder("f")
    vals = [b.input(f"x{i}", a.shape, a.dtype.name) for i, a in enumerate(arrays)]
    out = build(b, *vals)
    weights = rng.standard_normal(out.shape)
    loss = reduce_all(b, b.mul(out, b.constant(np.asarray(weights, out.dtype))))
    g = b.build([loss])
    if wrt is None:
        wrt = [i for i, a in enumerate(arrays) if a.dtype == np.float64]
    names = [f"x{i}" for i in wrt]
    G = grad(g, names)
    feeds = {f"x{i}": a for i, a in enumerate(arrays)}
    res = evaluate(G, feeds)
    assert np.allclose(res[0], evaluate(g, feeds)[0])
    for k, i in enumerate(wrt):
        analytic = res[1 + k]
        assert analytic.shape == arrays[i].shape and analytic.dtype == arrays[i].dtype
        numeric = np.zeros_like(arrays[i])
        for idx in np.ndindex(arrays[i].shape):
            plus = {**feeds, f"x{i}": arrays[i].copy()}
            minus = {**feeds, f"x{i}": arrays[i].copy()}
            plus[f"x{i}"][idx] += eps
            minus[f"x{i}"][idx] -= eps
            numeric[idx] = (evaluate(g, plus)[0] - evaluate(g, minus)[0]) / (2 * eps)
        err = np.abs(analytic - numeric)
        scale = np.max(np.abs(numeric)) if numeric.size else 0.0
        if not np.all(err <= atol + rtol * np.abs(numeric) + 1e-6 * scale):
            raise AssertionError(f"gradient of input {i} differs: max abs err {err.max():.3g}, "
                                 f"rel l2 {np.linalg.norm(err) / (np.linalg.norm(numeric) + 1e-30):.3g}"
                                 f"\nanalytic={analytic}\nnumeric={numeric}")
    return res
