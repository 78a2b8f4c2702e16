"""float32 polynomial math (llvm_math.py) against numpy over wide input ranges.

Reference: the float64 numpy function rounded to float32.  Target: rtol 1e-6 on finite
results, exact inf/nan/zero behaviour on the special inputs.
"""
import math

import numpy as np
import pytest

from apollo_py.codegen.llvm import compile_llvm

import codegen_kernels as K

SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-45, -1e-45, 1e-38,
                    88.72, 88.73, 89.0, -87.3, -103.0, -104.0, -110.0, 3.4e38, -3.4e38],
                   np.float32)


def _wide(rng, n=100_000):
    parts = [rng.uniform(-100, 100, n // 4), rng.normal(0, 3, n // 4),
             rng.uniform(-1, 1, n // 4) * 10.0 ** rng.uniform(-30, 2, n // 4),
             rng.uniform(-10, 10, n - 3 * (n // 4))]
    return np.concatenate(parts + [SPECIAL]).astype(np.float32)


def _positive(rng, n=100_000):
    parts = [10.0 ** rng.uniform(-45, 38.5, n // 3), rng.uniform(0, 10, n // 3),
             1 + rng.uniform(-1e-3, 1e-3, n - 2 * (n // 3))]
    return np.concatenate(parts + [SPECIAL]).astype(np.float32)


def _check(out, ref, rtol=1e-6, atol=0.0):
    ref32 = ref.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref32))
    inf = np.isinf(ref32)
    np.testing.assert_array_equal(out[inf], ref32[inf])
    fin = np.isfinite(ref32)
    # results in the float32 subnormal range carry absolute, not relative, precision
    np.testing.assert_allclose(out[fin], ref[fin], rtol=rtol, atol=max(atol, 1e-44))


def _run(op, x):
    ck = compile_llvm(K.unary_kernel(op, x.size))
    out = np.empty_like(x)
    ck([x, out])
    return out, ck


def test_exp(rng):
    x = _wide(rng)
    with np.errstate(over="ignore"):
        out, ck = _run("exp", x)
        _check(out, np.exp(x.astype(np.float64)))
    assert "<16 x float>" in ck.ir or "<8 x float>" in ck.ir
    assert "@expf" not in ck.ir and "llvm.exp" not in ck.ir


def test_log(rng):
    x = _positive(rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        out, _ = _run("log", x)
        _check(out, np.log(x.astype(np.float64)))


def test_tanh(rng):
    x = _wide(rng)
    out, _ = _run("tanh", x)
    _check(out, np.tanh(x.astype(np.float64)))


def test_erf(rng):
    x = np.concatenate([rng.normal(0, 2, 50_000), rng.uniform(-6, 6, 50_000)])
    x = np.concatenate([x, SPECIAL]).astype(np.float32)
    out, _ = _run("erf", x)
    ref = np.array([math.erf(v) if not math.isnan(v) else math.nan for v in x.astype(float)])
    _check(out, ref)


def test_sigmoid(rng):
    x = _wide(rng)
    with np.errstate(over="ignore"):
        out, _ = _run("sigmoid", x)
        _check(out, 1 / (1 + np.exp(-x.astype(np.float64))), atol=1e-38)


@pytest.mark.parametrize("op,fn", [("sqrt", np.sqrt), ("rsqrt", lambda v: 1 / np.sqrt(v)),
                                   ("reciprocal", lambda v: 1 / v), ("abs", np.abs),
                                   ("floor", np.floor), ("ceil", np.ceil),
                                   ("relu", lambda v: np.maximum(v, 0)), ("neg", np.negative)])
def test_simple_unary(op, fn, rng):
    x = _positive(rng, 20_000) if op in ("sqrt", "rsqrt") else _wide(rng, 20_000)
    with np.errstate(all="ignore"):
        out, _ = _run(op, x)
        _check(out, fn(x.astype(np.float64)), rtol=1e-6 if "sqrt" not in op else 2e-7 * 8)


@pytest.mark.parametrize("e", [0.0, 1.0, 2.0, 3.0, 4.0, -1.0, -2.0, 0.5, -0.5])
def test_pow_constant_fast_paths(e, rng):
    n = 10_000
    ck = compile_llvm(K.pow_kernel(n, e))
    a = (rng.uniform(0.01, 30, n) * np.where(rng.random(n) < 0.5, -1, 1)).astype(np.float32)
    if e in (0.5, -0.5):
        a = np.abs(a)
    out = np.empty_like(a)
    ck([a, np.zeros(n, np.float32), out])
    with np.errstate(all="ignore"):
        _check(out, np.power(a.astype(np.float64), e), rtol=1e-6)
    assert "@ap.powf" not in ck.ir


def test_pow_general(rng):
    n = 50_000
    ck = compile_llvm(K.pow_kernel(n))
    a = rng.uniform(-20, 20, n).astype(np.float32)
    b = rng.uniform(-4, 4, n).astype(np.float32)
    b[::3] = np.round(b[::3])  # integral exponents: negative bases allowed
    a[::11], b[::13] = 0.0, 0.0
    a[5], b[5] = 1.0, np.nan
    out = np.empty_like(a)
    ck([a, b, out])
    with np.errstate(all="ignore"):
        ref = np.power(a.astype(np.float64), b.astype(np.float64))
    # exp(b log|a|) loses ~|b log a| ulps in the product, so the general path is looser
    _check(out, ref, rtol=1e-5)
