"""Small generated matmuls shared with the native driver's helper thread (GemmStep.shares_tiles,
runtime/drive.py; docs/design/gemm.md "Small products"): on a 2-thread pool a DLRM-sized MLP
runs as one driver segment whose GEMM steps the caller and the helper each call once, claiming
tiles from a per-arena counter -- instead of a pool dispatch from Python per product.  Same
numbers with and without the helper (bit for bit: a tile's arithmetic does not depend on the
thread), against onnxruntime, with a helper that joins first, and with two calls at once."""
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import Options
from apollo_py.runtime import drive
from apollo_py.runtime.gemm_step import GemmStep

from .test_driver_helper import _rebuild, eager_helper

# DLRM's top MLP at batch 64: 64x512x100 (6.5 MFLOP) and 64x256x512 (16.8) are above
# SMALL_FLOPS (pool products before this change), 64x64x256 (2.1) runs inline; all share tiles
DIMS = (100, 512, 256, 64)


def _mlp(batch=64, dims=DIMS, seed=0):
    rng = np.random.default_rng(seed)
    nodes, inits, cur = [], [], "x"
    for q, (k, n) in enumerate(zip(dims, dims[1:])):
        inits += [numpy_helper.from_array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), f"w{q}"),
                  numpy_helper.from_array(rng.standard_normal(n).astype(np.float32) * 0.1, f"b{q}")]
        nodes.append(helper.make_node("Gemm", [cur, f"w{q}", f"b{q}"], [f"g{q}"], transB=1))
        cur = f"g{q}"
        if q < len(dims) - 2:
            nodes.append(helper.make_node("Relu", [cur], [f"r{q}"]))
            cur = f"r{q}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dims[0]])],
                              [helper.make_tensor_value_info(cur, TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((batch, dims[0])).astype(np.float32)
    return model, x


def _ort(model, x):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _python_gemms(exe) -> int:
    return sum(1 for kind, item in exe._program.entries if kind == "step" and isinstance(item, GemmStep))


@pytest.fixture(scope="module")
def compiled():
    model, x = _mlp()
    f = apollo_py.jit(model, options=Options(num_threads=2))
    return model, x, f, f.specialization({"x": x.shape})


def test_one_segment_with_the_helper_same_numbers(compiled, monkeypatch):
    model, x, f, exe = compiled
    monkeypatch.setattr(drive, "HELPER", False)
    _rebuild(exe)
    alone = f(x=x).copy()
    assert _python_gemms(exe) == 2 and not exe._program.scratch     # the two products over SMALL_FLOPS
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    for _ in range(20):
        np.testing.assert_array_equal(f(x=x), alone)
    prog = exe._program
    # pinned: every step in one native call, the three products shared (a counter each)
    assert _python_gemms(exe) == 0 and len(prog.segments) == 1 and prog.segments[0].parallel
    assert [type(s).__name__ for s in prog.segments[0].steps] == ["GemmStep"] * 3
    assert len(prog.scratch) == 3 and prog.segments[0].nsteps == 6      # counter reset + step each
    np.testing.assert_allclose(alone, _ort(model, x), rtol=1e-5, atol=1e-5)
    sync = exe._arenas._free[0].driver.sync
    assert (sync[6], sync[8]) in ((1, 1), (2, 0)), list(sync)


def test_helper_that_joins_first(compiled, monkeypatch):
    """A helper that has joined before the first step takes part in every product (it claims
    chunk [0, 1) or [1, 2) of each; either may be the caller's): same result."""
    model, x, f, exe = compiled
    monkeypatch.setattr(drive, "HELPER", False)
    _rebuild(exe)
    want = f(x=x).copy()
    started = []
    monkeypatch.setattr(drive, "_start_helper", eager_helper(started))
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    for _ in range(10):
        np.testing.assert_array_equal(f(x=x), want)
    for t in started:
        t.join(10)
        assert not t.is_alive()
    sync = exe._arenas._free[0].driver.sync
    assert sync[6] == 1 and sync[8] == 1 and sync[5] == 2     # the last product's two chunks done


def test_concurrent_calls_have_their_own_counters(compiled, monkeypatch):
    model, x, f, exe = compiled
    want = f(x=x).copy()
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    errors = []
    xs = [x, x[::-1].copy()]
    wants = [want, f(x=xs[1]).copy()]

    def loop(q):
        try:
            for _ in range(40):
                np.testing.assert_array_equal(f(x=xs[q]), wants[q])
        except BaseException as exc:      # noqa: BLE001 - reported below
            errors.append(exc)
    ts = [threading.Thread(target=loop, args=(q,)) for q in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in ts)
    tables = [a.driver for a in exe._arenas._free if a.driver is not None]
    assert len(tables) == 2 and not set(map(id, tables[0].scratch.values())) & set(map(id, tables[1].scratch.values()))


def test_larger_pool_keeps_pool_dispatch(monkeypatch):
    """On more than two threads the pool gives a product more threads than the one helper: the
    products above SMALL_FLOPS stay pool dispatches."""
    model, x = _mlp(dims=(100, 512, 256))
    monkeypatch.setattr(drive, "HELPER", True)
    f = apollo_py.jit(model, options=Options(num_threads=4))
    got = f(x=x)
    exe = f.specialization({"x": x.shape})
    assert _python_gemms(exe) == 2 and not exe._program.scratch
    np.testing.assert_allclose(got, _ort(model, x), rtol=1e-5, atol=1e-5)
