"""Layer-1 results stored on disk (layers/fuse_store.py): a warm compile in a new process
neither schedules with isl nor renders LLVM text nor runs LLVM."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.codegen import cached
from apollo_py.codegen.llvm import render_llvm
from apollo_py.layers import fuse_memo, fuse_store
from apollo_py.runtime.reference import evaluate


def _model():
    b = ap.GraphBuilder("ln_gelu")
    x = b.input("x", (64, 96))
    w = b.input("w", (96, 32))
    m = b.reduce_sum(x, axes=(1,), keepdims=True) * (1 / 96)
    d = x - m
    v = b.reduce_sum(d * d, axes=(1,), keepdims=True) * (1 / 96)
    y = d / b.sqrt(v + 1e-5)
    h = b.matmul(y, w)
    return b.build([b.tanh(h) * h, b.reduce_max(y, axes=(0,), keepdims=False)])


def _feeds():
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((64, 96)).astype(np.float32),
            "w": rng.standard_normal((96, 32)).astype(np.float32)}


def _new_process(monkeypatch):
    """Forget what this process compiled, as a new process would."""
    for mod, name in ((fuse_memo, "_MEMO"), (cached, "_LOADED"), (cached, "_ENGINES"), (cached, "_TEXTS")):
        monkeypatch.setattr(mod, name, type(getattr(mod, name))(getattr(mod, name).maxsize))
    monkeypatch.setattr(cached, "_CACHES", {})


def test_loop_ir_round_trips_through_json():
    import json
    g = _model()
    f = ap.jit(g, options=ap.Options(machine="dev-2core"))
    f.run(**_feeds())
    loops = [k.fused.loop for k in f.plan.kernels if k.fused is not None]
    assert loops
    for loop in loops:
        back = fuse_store.decode(json.loads(json.dumps(fuse_store.encode(loop))))
        assert back == loop and render_llvm(back) == render_llvm(loop)


def test_warm_compile_does_no_isl_and_no_llvm_work(tmp_path, monkeypatch):
    g, feeds = _model(), _feeds()
    opts = ap.Options(cache_dir=str(tmp_path), machine="dev-2core")
    want = evaluate(g, feeds)
    _new_process(monkeypatch)       # kernels other tests compiled in this process are not on disk here
    cold = ap.jit(g, options=opts).run(**feeds)
    _new_process(monkeypatch)

    def forbidden(*a, **k):
        raise AssertionError("a warm compile must not get here")
    monkeypatch.setattr(fuse_memo, "fuse_micro_graph", forbidden)    # layer 1 (isl)
    monkeypatch.setattr(cached, "kernel_key", forbidden)             # rendering LLVM text
    monkeypatch.setattr(cached, "optimize_ir", forbidden, raising=False)
    from apollo_py.codegen import llvm
    monkeypatch.setattr(llvm, "optimize_ir", forbidden)              # LLVM's optimiser
    monkeypatch.setattr(llvm, "run_o3", forbidden)
    warm = ap.jit(g, options=opts).run(**feeds)
    assert len(warm) == len(cold) == len(want)
    for a, b, w in zip(warm, cold, want, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-4)


def test_corrupt_store_entry_is_a_miss(tmp_path, monkeypatch):
    g, feeds = _model(), _feeds()
    opts = ap.Options(cache_dir=str(tmp_path), machine="dev-2core")
    ap.jit(g, options=opts).run(**feeds)
    _new_process(monkeypatch)
    calls = []
    real = fuse_store.load

    def spoiled(cache, key, cnodes):
        calls.append(key)
        cache.put(key, b"{not json", {"kind": "layer1"})
        return real(cache, key, cnodes)
    monkeypatch.setattr(fuse_store, "load", spoiled)
    got = ap.jit(g, options=opts).run(**feeds)
    assert calls
    for a, w in zip(got, evaluate(g, feeds)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-4)
