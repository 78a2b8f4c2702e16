"""target="cpu": generated LLVM kernels against onnxruntime / the numpy reference."""
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.feedback.log import read_events
from apollo_py.runtime.reference import evaluate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import make_models as mm  # noqa: E402

ort = pytest.importorskip("onnxruntime")

MODELS = ["make_mlp", "make_conv_block", "make_attention", "make_layernorm_gelu", "make_softmax_chain"]


def _close(got, want, rtol=1e-5, atol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype
    err = np.abs(got.astype(np.float64) - want)
    rel_l2 = np.linalg.norm(err) / max(np.linalg.norm(want), 1e-30)
    assert np.allclose(got, want, rtol=rtol, atol=atol), f"l_inf {err.max():.3g}, rel l2 {rel_l2:.3g}"


@pytest.mark.parametrize("name", MODELS)
def test_example_models_match_onnxruntime(name):
    model = getattr(mm, name)()
    feeds = mm.example_inputs(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = ap.jit(model, target="cpu").run(**feeds)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


def _softmax_graph(rows=64, cols=128):
    b = ap.GraphBuilder("softmax")
    x = b.input("x", (rows, cols))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)])


def test_softmax_is_one_kernel():
    g = _softmax_graph()
    f = ap.jit(g, target="cpu")
    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    _close(f(x), evaluate(g, {"x": x})[0], rtol=1e-6, atol=1e-7)
    kinds = [k.to_dict()["kind"] for k in f.plan.kernels]
    assert kinds == ["kernel"]
    assert f.plan.kernels[0].fused.parallel_dims >= 1


def _listing1(n=1, c=8, h=16, w=16):
    b = ap.GraphBuilder("bias_maxpool")
    x = b.input("x", (n, c, h, w))
    bias = b.input("bias", (1, c, 1, 1))
    y = b.window_reduce(x + bias, reducer="max", kernel=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0),
                        dilations=(1, 1))
    return b.build([y])


def _listing3(m=4, n=8, p=8, q=8):
    b = ap.GraphBuilder("bias_reduce")
    x = b.input("x", (m, n, p, q))
    bias = b.input("bias", (1, n, 1, q))
    return b.build([b.reduce_sum(x + bias, axes=(1, 3))])


@pytest.mark.parametrize("make", [_listing1, _listing3])
def test_seed_listings_are_one_kernel_without_intermediate(make):
    g = make()
    f = ap.jit(g, target="cpu")
    rng = np.random.default_rng(1)
    feeds = {v: rng.standard_normal(g.types[v].shape).astype(np.float32) for v in g.inputs}
    _close(f(**feeds), evaluate(g, feeds)[0])
    assert [k.to_dict()["kind"] for k in f.plan.kernels] == ["kernel"]
    exe = f.specialization({v: a.shape for v, a in feeds.items()})
    assert exe.memory.arena_bytes == 0  # no full-size intermediate tensor anywhere
    loop = f.plan.kernels[0].fused.loop
    assert all(p.name in g.inputs or p.name in g.outputs for p in loop.params)


def test_tiny_schedule_budget_logs_event_and_stays_correct(tmp_path):
    log = tmp_path / "feedback.jsonl"
    opts = ap.Options(target="cpu", schedule_budget=50, feedback_path=str(log), cache_dir=str(tmp_path))
    b = ap.GraphBuilder("budget")
    x = b.input("x", (16, 32))
    bias = b.input("b", (32,))
    y = b.tanh(b.exp(x + bias) * 0.5)
    s = b.reduce_sum(y, axes=(1,), keepdims=True)
    g = b.build([y - s])
    f = ap.jit(g, options=opts)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((16, 32)).astype(np.float32),
             "b": rng.standard_normal(32).astype(np.float32)}
    _close(f(**feeds), evaluate(g, feeds)[0])
    events = read_events(str(log))
    assert any(e["event"] == "schedule_budget_exceeded" for e in events)


def test_concurrent_calls_from_threads():
    g = _softmax_graph(256, 64)
    f = ap.jit(g, target="cpu")
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((256, 64)).astype(np.float32) for _ in range(6)]
    want = [evaluate(g, {"x": x})[0] for x in xs]
    got = [[] for _ in xs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                got[i].append(f(xs[i]))
        except BaseException as e:      # noqa: BLE001 - reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for results, w in zip(got, want, strict=True):
        assert len(results) == 5           # every call of every thread is checked
        for g_ in results:
            _close(g_, w, rtol=1e-6, atol=1e-7)


def test_c_renderer_agrees_on_each_class():
    from apollo_py.codegen.c import compile_c, find_cc
    if find_cc() is None:
        pytest.skip("no C compiler")
    from apollo_py.codegen.llvm import compile_llvm
    rng = np.random.default_rng(4)
    for g in (_softmax_graph(8, 32), _listing1(1, 2, 8, 8), _listing3(2, 4, 4, 4)):
        f = ap.jit(g, target="cpu")
        feeds = {v: rng.standard_normal(g.types[v].shape).astype(np.float32) for v in g.inputs}
        f(**feeds)
        for spec in f.plan.kernels:
            fk = spec.fused
            bufs_c = [feeds[v].copy() if v in feeds else np.zeros(g.types[v].shape, np.float32)
                      for v in fk.param_values]
            bufs_l = [b.copy() for b in bufs_c]
            compile_c(fk.loop)(bufs_c)
            compile_llvm(fk.loop)(bufs_l)
            for a, b_ in zip(bufs_c, bufs_l):
                np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)


def test_feedback_report_groups_events(tmp_path):
    from apollo_py.cli import main
    log = tmp_path / "feedback.jsonl"
    opts = ap.Options(target="cpu", schedule_budget=50, feedback_path=str(log), cache_dir=str(tmp_path))
    f = ap.jit(_softmax_graph(8, 16), options=opts)
    f(np.ones((8, 16), np.float32))
    from apollo_py.feedback.report import render, summarize
    rows = summarize(read_events(str(log)))
    assert rows and rows[0]["event"] == "schedule_budget_exceeded" and rows[0]["count"] >= 1
    assert "schedule_budget_exceeded" in render(opts) and "<table" in render(opts, html=True)
