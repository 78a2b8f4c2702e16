"""The native driver (codegen/driver.py, runtime/drive.py): runs of inline kernels and cblas
calls go through one native call per segment, with the same numbers as running every step
from Python (``use_driver = False``)."""
import ctypes

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.runtime.blas import cblas

from ..fuzz_graphs import random_graph


def _chain(n, shape=(16, 16), gather_at=None):
    """``n`` reduce_max/sub pairs along alternating axes: ``n`` kernels that do not fuse; a
    gather of the rows in reverse order after pair ``gather_at`` (a gather kernel, inside the
    segment; tests patch it back to a numpy step to split the kernels in two runs)."""
    b = ap.GraphBuilder(f"chain{n}")
    y = b.input("x", shape)
    for i in range(n):
        y = y - b.reduce_max(y, axes=(i % 2,), keepdims=True)
        if i == gather_at:
            y = b.gather(y, b.constant(np.arange(shape[0] - 1, -1, -1).astype(np.int64)), axis=0)
    return b.build([y])


def _chain_numpy(x, n, gather_at=None):
    y = x.astype(np.float64)
    for i in range(n):
        y = y - y.max(axis=i % 2, keepdims=True)
        if i == gather_at:
            y = y[::-1]
    return y


def _counting(exe):
    """Make ``exe`` count its driver calls; returns the list that grows by one per call."""
    calls = []
    fn = exe._driver_fn

    def counted(block):
        # the segment's number of steps: word 1 of its call block (codegen/driver.py, block_ir)
        calls.append(ctypes.c_int64.from_address(block + 8).value)
        return fn(block)
    exe._driver_fn = counted
    return calls


def _off(f, *args):
    """``f``'s outputs for ``args`` with every step run from Python."""
    exe = f.specialization({n: a.shape for n, a in zip(f.input_names, args)})
    exe.use_driver = False
    try:
        return f(*args)
    finally:
        exe.use_driver = True


def test_kernels_run_as_one_driver_call():
    n = 6
    f = ap.jit(_chain(n), options=ap.Options(num_threads=2))
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    first = f(x)
    exe = f.specialization({"x": x.shape})
    assert len(f.plan.kernels) == n and all(k.fused is not None for k in f.plan.kernels), str(f.plan)
    assert [e[0] for e in exe._program.entries] == ["drive"]
    calls = _counting(exe)
    for _ in range(3):
        got = f(x)
    assert calls == [n] * 3                 # one native call per model call, all n kernels
    np.testing.assert_allclose(got, _chain_numpy(x, n), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, first)
    np.testing.assert_array_equal(got, _off(f, x))


def test_numpy_step_splits_the_schedule_into_two_segments(monkeypatch):
    from apollo_py.layers import lowering
    monkeypatch.setattr(lowering, "_gather_step", lambda *a: None)     # the gather as a numpy step
    n = 6
    f = ap.jit(_chain(n, gather_at=2), options=ap.Options(num_threads=2))
    x = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
    f(x)
    exe = f.specialization({"x": x.shape})
    assert [e[0] for e in exe._program.entries] == ["drive", "step", "drive"], str(f.plan)
    kinds = [k.to_dict()["kind"] for k in f.plan.kernels]
    cut = kinds.index("reference")
    assert kinds == ["kernel"] * cut + ["reference"] + ["kernel"] * (len(kinds) - cut - 1), str(f.plan)
    calls = _counting(exe)
    got = f(x)
    assert calls == [cut, len(kinds) - cut - 1]
    np.testing.assert_allclose(got, _chain_numpy(x, n, gather_at=2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, _off(f, x))


def test_gather_kernel_runs_inside_the_segment():
    n = 6
    f = ap.jit(_chain(n, gather_at=2), options=ap.Options(num_threads=2))
    x = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
    f(x)
    exe = f.specialization({"x": x.shape})
    assert [e[0] for e in exe._program.entries] == ["drive"], str(f.plan)
    calls = _counting(exe)
    got = f(x)
    assert calls == [len(f.plan.kernels)]
    np.testing.assert_allclose(got, _chain_numpy(x, n, gather_at=2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, _off(f, x))


def test_out_and_concurrent_arenas_match_python_steps():
    f = ap.jit(_chain(4), options=ap.Options(num_threads=2))
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(3)]
    want = [_off(f, x) for x in xs]
    out = np.empty((16, 16), np.float32)
    assert f(xs[0], out=out) is out
    np.testing.assert_array_equal(out, want[0])
    exe = f.specialization({"x": (16, 16)})
    a1, a2 = exe._arenas.acquire(), exe._arenas.acquire()   # a second arena, as a second thread gets
    exe._arenas.release(a2)
    got = f(xs[1])
    exe._arenas.release(a1)
    np.testing.assert_array_equal(got, want[1])
    np.testing.assert_array_equal(f(xs[2]), want[2])


@pytest.mark.skipif(cblas() is None, reason="no cblas next to numpy: matmuls stay numpy steps")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_blas_call_runs_inside_the_segment(dtype):
    b = ap.GraphBuilder("mm_chain")
    x, w = b.input("x", (8, 12), dtype), b.input("w", (16, 12), dtype)
    h = b.tanh(b.matmul(x, b.transpose(w, perm=(1, 0))))
    y = b.matmul(b.transpose(h, perm=(1, 0)), h)          # [16, 16], transposes folded into flags
    f = ap.jit(b.build([b.exp(y * 0.1)]), options=ap.Options(num_threads=2))
    rng = np.random.default_rng(3)
    xv, wv = (rng.standard_normal(s).astype(dtype) for s in ((8, 12), (16, 12)))
    got = f(xv, wv)
    exe = f.specialization({"x": xv.shape, "w": wv.shape})
    kinds = [k.to_dict()["kind"] for k in f.plan.kernels]
    assert "blas" in kinds, str(f.plan)
    assert [e[0] for e in exe._program.entries] == ["drive"], str(f.plan)
    calls = _counting(exe)
    got = f(xv, wv)
    assert calls == [len(kinds)]
    hv = np.tanh(xv.astype(np.float64) @ wv.T.astype(np.float64))
    rtol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(got, np.exp((hv.T @ hv) * 0.1), rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(got, _off(f, xv, wv))


@pytest.mark.parametrize("seed", range(0, 40))
def test_random_graphs_identical_with_driver_on_and_off(seed):
    g, feeds = random_graph(seed)
    f = ap.jit(g)
    on = f.run(**feeds)
    exe = f.specialization({k: v.shape for k, v in feeds.items()})
    exe.use_driver = False
    off = f.run(**feeds)
    assert len(on) == len(off)
    for a, b in zip(on, off):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_wrong_dtype_input_to_the_executable_is_refused():
    f = ap.jit(_chain(2))
    x = np.zeros((16, 16), np.float32)
    f(x)
    exe = f.specialization({"x": x.shape})
    with pytest.raises(ap.InputError, match="'x'"):
        exe.run({"x": np.zeros((16, 16), np.float64)})


@pytest.mark.skipif(cblas() is None, reason="no cblas next to numpy: matmuls stay numpy steps")
def test_blas_update_copies_its_accumulator_in_the_segment():
    """``p - 0.25 * xᵀ @ g``: a memmove of p into the output, then a gemm with beta = 1, both
    inside one native call; in place (run_updating) the copy is onto itself."""
    b = ap.GraphBuilder("upd")
    p, x, g = b.input("p", (40, 30)), b.input("x", (20, 40)), b.input("g", (20, 30))
    out = b.sub(p, b.mul(b.matmul(b.transpose(x, perm=(1, 0)), g), b.constant(np.array(0.25, np.float32))))
    f = ap.jit(b.build([out]), options=ap.Options(num_threads=2))
    rng = np.random.default_rng(4)
    pv, xv, gv = (rng.standard_normal(s).astype(np.float32) for s in ((40, 30), (20, 40), (20, 30)))
    want = pv - 0.25 * (xv.T.astype(np.float64) @ gv)
    got = f(pv, xv, gv)
    exe = f.specialization({"p": pv.shape, "x": xv.shape, "g": gv.shape})
    assert f.plan.kernels[0].blas.acc == "p" and [e[0] for e in exe._program.entries] == ["drive"]
    calls = _counting(exe)
    np.testing.assert_allclose(f(pv, xv, gv), want, rtol=1e-5, atol=1e-5)
    assert calls == [2]                     # copy + gemm
    np.testing.assert_array_equal(got, _off(f, pv, xv, gv))
    p_in = pv.copy()
    outs = f.run_updating({f.output_names[0]: "p"}, p=p_in, x=xv, g=gv)
    assert outs[0] is p_in
    np.testing.assert_allclose(p_in, want, rtol=1e-5, atol=1e-5)
