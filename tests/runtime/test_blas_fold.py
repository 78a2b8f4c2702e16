"""BLAS folding (layers/blas_fold.py, runtime/blas.py) and in-place updates (runtime/inplace.py).

Numbers are checked against float64 numpy; the folded step structure is pinned from the plan.
"""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.runtime.blas import cblas

pytestmark = pytest.mark.skipif(cblas() is None, reason="no cblas next to numpy: matmuls stay numpy steps")

RTOL, ATOL = 1e-5, 1e-5


def _kinds(f):
    return [s.to_dict()["kind"] for s in f.plan.kernels]


def _rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_operand_transposes_become_flags(ta, tb):
    m, k, n = 37, 70, 53
    b = ap.GraphBuilder("mmT")
    a_in = b.input("a", (k, m) if ta else (m, k))
    b_in = b.input("b", (n, k) if tb else (k, n))
    a_v = b.transpose(a_in, perm=(1, 0)) if ta else a_in
    b_v = b.transpose(b_in, perm=(1, 0)) if tb else b_in
    f = ap.jit(b.build([b.matmul(a_v, b_v)]), target="cpu")
    assert _kinds(f) == ["blas"], str(f.plan)
    d = f.plan.kernels[0].blas
    assert (d.trans_a, d.trans_b) == (ta, tb)
    rng = np.random.default_rng(0)
    av, bv = _rand(rng, *a_in.shape), _rand(rng, *b_in.shape)
    want = (av.T if ta else av).astype(np.float64) @ (bv.T if tb else bv)
    np.testing.assert_allclose(f(av, bv), want, rtol=RTOL, atol=ATOL)


def test_result_transpose_swaps_operands():
    b = ap.GraphBuilder("mmT_out")
    x, w = b.input("x", (64, 48)), b.input("w", (48, 96))
    f = ap.jit(b.build([b.transpose(b.matmul(x, w), perm=(1, 0))]), target="cpu")
    assert _kinds(f) == ["blas"], str(f.plan)
    rng = np.random.default_rng(1)
    xv, wv = _rand(rng, 64, 48), _rand(rng, 48, 96)
    np.testing.assert_allclose(f(xv, wv), (xv.astype(np.float64) @ wv).T, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("form", ["sub", "add", "add_left", "scale_left"])
def test_scaled_update_folds_into_beta(form):
    b = ap.GraphBuilder("upd")
    p, x, g = b.input("p", (40, 30)), b.input("x", (20, 40)), b.input("g", (20, 30))
    prod = b.matmul(b.transpose(x, perm=(1, 0)), g)
    c = b.constant(np.array(0.25, np.float32))
    scaled = b.mul(c, prod) if form == "scale_left" else b.mul(prod, c)
    out = {"sub": lambda: b.sub(p, scaled), "add": lambda: b.add(p, scaled),
           "add_left": lambda: b.add(scaled, p), "scale_left": lambda: b.sub(p, scaled)}[form]()
    f = ap.jit(b.build([out]), target="cpu")
    assert _kinds(f) == ["blas"], str(f.plan)
    d = f.plan.kernels[0].blas
    assert d.acc == "p" and d.trans_a and d.alpha == (-0.25 if form in ("sub", "scale_left") else 0.25)
    rng = np.random.default_rng(2)
    pv, xv, gv = _rand(rng, 40, 30), _rand(rng, 20, 40), _rand(rng, 20, 30)
    sign = -1 if form in ("sub", "scale_left") else 1
    want = pv + sign * 0.25 * (xv.T.astype(np.float64) @ gv)
    got = f(pv, xv, gv)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert not np.shares_memory(got, pv)
    np.testing.assert_array_equal(pv, _rand(np.random.default_rng(2), 40, 30))   # input untouched


def test_shared_transpose_and_read_product_do_not_fold():
    """A transpose read twice stays a step; a product read by a second consumer keeps its value."""
    b = ap.GraphBuilder("nofold")
    x, w, p = b.input("x", (32, 16)), b.input("w", (32, 24)), b.input("p", (16, 24))
    xt = b.transpose(x, perm=(1, 0))
    prod = b.matmul(xt, w)
    upd = b.sub(p, b.mul(prod, b.constant(np.array(0.5, np.float32))))
    f = ap.jit(b.build([upd, b.tanh(prod), b.relu(xt)]), target="cpu")
    kinds = _kinds(f)
    assert kinds.count("blas") == 1
    d = next(s.blas for s in f.plan.kernels if s.blas is not None)
    assert d.acc is None and not d.trans_a
    rng = np.random.default_rng(3)
    xv, wv, pv = _rand(rng, 32, 16), _rand(rng, 32, 24), _rand(rng, 16, 24)
    prod64 = xv.T.astype(np.float64) @ wv
    got = f(xv, wv, pv)
    for g, want in zip(got, (pv - 0.5 * prod64, np.tanh(prod64), np.maximum(xv.T, 0))):
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("xs,ws", [((3, 5, 17), (17, 9)), ((17,), (17, 9)), ((6, 17), (17,))])
def test_flattened_and_vector_operands(xs, ws):
    b = ap.GraphBuilder("mm_nd")
    x, w = b.input("x", xs), b.input("w", ws)
    f = ap.jit(b.build([b.matmul(x, w)]), target="cpu")
    assert _kinds(f) == ["blas"], str(f.plan)
    rng = np.random.default_rng(4)
    xv, wv = _rand(rng, *xs), _rand(rng, *ws)
    np.testing.assert_allclose(f(xv, wv), np.matmul(xv.astype(np.float64), wv), rtol=RTOL, atol=ATOL)


def test_float64_uses_dgemm():
    b = ap.GraphBuilder("mm64")
    x, w = b.input("x", (33, 21), "float64"), b.input("w", (33, 12), "float64")
    f = ap.jit(b.build([b.matmul(b.transpose(x, perm=(1, 0)), w)]), target="cpu")
    assert _kinds(f) == ["blas"] and f.plan.kernels[0].blas.dtype == "float64"
    rng = np.random.default_rng(5)
    xv, wv = rng.standard_normal((33, 21)), rng.standard_normal((33, 12))
    np.testing.assert_allclose(f(xv, wv), xv.T @ wv, rtol=1e-12, atol=1e-12)


def _update_graph():
    b = ap.GraphBuilder("sgd")
    w, x, g = b.input("w", (50, 40)), b.input("x", (30, 50)), b.input("g", (30, 40))
    lr = b.constant(np.array(0.1, np.float32))
    w_new = b.sub(w, b.mul(b.matmul(b.transpose(x, perm=(1, 0)), g), lr))
    v = b.input("v", (40,))
    v_new = b.sub(v, b.mul(b.reduce_sum(g, axes=(0,)), lr))
    return b.build([w_new, v_new, b.reduce_sum(b.matmul(x, w), axes=(0, 1))])


def test_run_updating_writes_into_the_inputs():
    f = ap.jit(_update_graph(), target="cpu")
    rng = np.random.default_rng(6)
    w, x, g, v = _rand(rng, 50, 40), _rand(rng, 30, 50), _rand(rng, 30, 40), _rand(rng, 40)
    w0, v0 = w.copy(), v.copy()
    exe = f.specialization({"w": w.shape, "x": x.shape, "g": g.shape, "v": v.shape})
    names = f.output_names
    assert exe.inplace_reason(names[0], "w") == ""       # W - lr * xᵀ @ g: BLAS with beta = 1
    assert exe.inplace_reason(names[1], "v") == ""       # elementwise kernel
    assert exe.inplace_reason(names[0], "v") != ""       # shapes differ
    outs = f.run_updating({names[0]: "w", names[1]: "v"}, w=w, x=x, g=g, v=v)
    assert outs[0] is w and outs[1] is v
    np.testing.assert_allclose(w, w0 - 0.1 * (x.T.astype(np.float64) @ g), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(v, v0 - 0.1 * g.sum(0, dtype=np.float64), rtol=RTOL, atol=ATOL)
    # the third output read the old w (before the update)
    np.testing.assert_allclose(outs[2], (x.astype(np.float64) @ w0).sum(), rtol=1e-4)


def test_run_updating_copies_when_unsafe():
    """The new value is returned as well, so it cannot be written over the input it reads."""
    b = ap.GraphBuilder("unsafe")
    w = b.input("w", (64,))
    w_new = b.mul(w, b.constant(np.array(2.0, np.float32)))
    f = ap.jit(b.build([w_new, b.reduce_sum(b.mul(w, w_new), axes=(0,))]), target="cpu")
    w_in = np.arange(64, dtype=np.float32)
    exe = f.specialization({"w": (64,)})
    assert exe.inplace_reason(f.output_names[0], "w") != ""
    outs = f.run_updating({f.output_names[0]: "w"}, w=w_in)
    assert outs[0] is w_in
    np.testing.assert_allclose(w_in, 2 * np.arange(64))
    np.testing.assert_allclose(outs[1], float((2 * np.arange(64.0) ** 2).sum()), rtol=1e-6)


def test_run_updating_checks_its_arguments():
    f = ap.jit(_update_graph(), target="cpu")
    rng = np.random.default_rng(7)
    feeds = dict(w=_rand(rng, 50, 40), x=_rand(rng, 30, 50), g=_rand(rng, 30, 40), v=_rand(rng, 40))
    with pytest.raises(ap.errors.InputError, match="must map an output"):
        f.run_updating({"nope": "w"}, **feeds)
    with pytest.raises(ap.errors.InputError, match="target of two outputs"):
        f.run_updating({f.output_names[0]: "w", f.output_names[1]: "w"}, **feeds)
    feeds["w"] = np.asfortranarray(feeds["w"])
    with pytest.raises(ap.errors.InputError, match="C-contiguous"):
        f.run_updating({f.output_names[0]: "w"}, **feeds)


def test_reference_target_run_updating_copies():
    f = ap.jit(_update_graph(), target="reference")
    rng = np.random.default_rng(8)
    w, x, g, v = _rand(rng, 50, 40), _rand(rng, 30, 50), _rand(rng, 30, 40), _rand(rng, 40)
    w0 = w.copy()
    outs = f.run_updating({f.output_names[0]: "w"}, w=w, x=x, g=g, v=v)
    assert outs[0] is w
    np.testing.assert_allclose(w, w0 - 0.1 * (x.T.astype(np.float64) @ g), rtol=RTOL, atol=ATOL)


def test_kernel_after_a_blas_call_runs_inline():
    """OpenBLAS's threads spin after a call: the epilogue right after it runs on the caller."""
    b = ap.GraphBuilder("mm_relu")
    x, w, bias = b.input("x", (256, 128)), b.input("w", (128, 512)), b.input("bias", (512,))
    # the decision rests on Machine.inline_bytes (the 512 KiB epilogue is below it): pinned
    f = ap.jit(b.build([b.relu(b.add(b.matmul(x, w), bias))]), options=ap.Options(target="cpu", machine="dev-2core"))
    rng = np.random.default_rng(10)
    xv, wv, bv = _rand(rng, 256, 128), _rand(rng, 128, 512), _rand(rng, 512)
    np.testing.assert_allclose(f(xv, wv, bv), np.maximum(xv.astype(np.float64) @ wv + bv, 0), rtol=RTOL, atol=ATOL)
    from apollo_py.runtime.cpu import _parts
    exe = f.specialization({"x": (256, 128), "w": (128, 512), "bias": (512,)})
    kinds = [kind for kind, _ in exe._schedule]
    assert kinds == ["step", "kernels"]
    epilogue = exe._schedule[1][1][0]
    assert _parts(epilogue, exe.machine) == 1


@pytest.mark.parametrize("xs,bias_shape", [((64, 48), (96,)), ((4, 16, 48), (96,)), ((64, 48), (1, 96))])
def test_bias_add_folds_into_beta(xs, bias_shape):
    b = ap.GraphBuilder("linear")
    x, w, bias = b.input("x", xs), b.input("w", (48, 96)), b.input("bias", bias_shape)
    f = ap.jit(b.build([b.add(b.matmul(x, w), bias)]), target="cpu")
    assert _kinds(f) == ["blas"], str(f.plan)
    assert f.plan.kernels[0].blas.acc == "bias" and f.plan.kernels[0].blas.alpha == 1.0
    rng = np.random.default_rng(11)
    xv, wv, bv = _rand(rng, *xs), _rand(rng, 48, 96), _rand(rng, *bias_shape)
    np.testing.assert_allclose(f(xv, wv, bv), np.matmul(xv.astype(np.float64), wv) + bv, rtol=RTOL, atol=ATOL)


def test_bias_that_does_not_broadcast_to_the_product_stays_a_kernel():
    b = ap.GraphBuilder("outer")
    x, w, col = b.input("x", (1, 48)), b.input("w", (48, 96)), b.input("col", (32, 1))
    f = ap.jit(b.build([b.add(b.matmul(x, w), col)]), target="cpu")    # (1,96) + (32,1) -> (32,96)
    assert _kinds(f) == ["blas", "kernel"], str(f.plan)
    rng = np.random.default_rng(12)
    xv, wv, cv = _rand(rng, 1, 48), _rand(rng, 48, 96), _rand(rng, 32, 1)
    np.testing.assert_allclose(f(xv, wv, cv), xv.astype(np.float64) @ wv + cv, rtol=RTOL, atol=ATOL)


def test_inplace_refuses_a_kernel_reading_the_input_for_another_output():
    """o1 = 2w and o2 = o1 + w in one kernel: writing o1 into w would clobber w[i] before the
    add reads it (the add reads w but is not an ancestor of o1)."""
    b = ap.GraphBuilder("two_outs")
    w = b.input("w", (64, 32))
    o1 = b.mul(w, b.constant(np.array(2.0, np.float32)))
    o2 = b.add(o1, w)
    f = ap.jit(b.build([o1, o2]), target="cpu")
    exe = f.specialization({"w": (64, 32)})
    assert [k for k, _ in exe._schedule] == ["kernels"], str(f.plan)     # one kernel, two outputs
    assert "for another output" in exe.inplace_reason(f.output_names[0], "w")
    wv = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    w0 = wv.copy()
    outs = f.run_updating({f.output_names[0]: "w"}, w=wv)
    np.testing.assert_array_equal(wv, 2 * w0)
    np.testing.assert_array_equal(outs[1], 3 * w0)
