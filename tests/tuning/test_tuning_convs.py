"""Decisions of convs the GEMM blocking rounds did not reach: the row-reading conv's blocking
(``gemm:`` pieces: MR, NR, VL, KC, panels, ``nc_max``; codegen/conv_rows.py) and the direct
conv's form and threads (``conv:`` pieces; tuning/convs.py).  They change the compiled code,
never the numbers, and replay from the database."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap
from apollo_py.runtime.gemm_step import gemm_key
from apollo_py.tuning import db
from apollo_py.tuning.convs import direct_candidates, direct_key
from apollo_py.tuning.space import rows_candidates
from apollo_py.tuning.tuner import plan_steps


def _model():
    """A dense 3x3 conv (32 -> 64 channels at 28x28: the row-reading kernel), then three
    depthwise 3x3 convs with 14x14 outputs (direct, flat form; the last two alike), each with
    a ReLU."""
    rng = np.random.default_rng(0)
    w0 = numpy_helper.from_array((rng.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32), "w0")
    w1 = numpy_helper.from_array((rng.standard_normal((64, 1, 3, 3)) * 0.3).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((64, 1, 3, 3)) * 0.3).astype(np.float32), "w2")
    w3 = numpy_helper.from_array((rng.standard_normal((64, 1, 3, 3)) * 0.3).astype(np.float32), "w3")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], group=64, strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=64),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1], group=64),
             helper.make_node("Relu", ["c3"], ["y"])]
    g = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 28, 28])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 14, 14])],
                          initializer=[w0, w1, w2, w3])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


X = np.random.default_rng(1).standard_normal((1, 32, 28, 28)).astype(np.float32)


def _run(tmp_path, **kw):
    f = ap.jit(_model(), options=ap.Options(cache_dir=str(tmp_path), machine="dev-2core", num_threads=2, **kw))
    out = f.run(x=X)
    return f.specialization({"x": X.shape}), out


def _by_kind(exe, name):
    return [s.compiled for s in exe.steps if type(getattr(s, "compiled", None)).__name__ == name]


def test_row_conv_blocking_and_direct_conv_decisions_change_the_code_not_the_numbers(tmp_path):
    from apollo_py.codegen.conv_direct import flat_form
    untuned, want = _run(tmp_path, tune="off")
    (rows,) = _by_kind(untuned, "CompiledConvRows")
    dconvs = _by_kind(untuned, "CompiledDirectConv")
    assert len(dconvs) == 3 and all(flat_form(c.desc) for c in dconvs)
    # candidates: each changes the row conv's layout or micro-tile; the direct conv's form and threads
    cands = rows_candidates(rows.desc, {}, 2)
    assert {"mr", "nr", "kc-"} <= set(cands) and "threads" not in cands and "direct_a" not in cands, cands
    dc = direct_candidates(dconvs[0].desc, {}, dconvs[0].inline, 2)
    assert dc["conv form"] == {"form": "row"} and dc["conv threads"] == {"threads": 2 if dconvs[0].inline else 1}
    # the strided one and the two alike: two pieces (a piece key ignores value names)
    keys = [direct_key(c.desc) for c in dconvs]
    assert keys[0] != keys[1] == keys[2] and dconvs[1].desc.head != dconvs[2].desc.head
    blocking = {"nr": 16, "kc": 128, "nc_max": 128, "mr": 8}
    records = {gemm_key(rows.desc): {"kind": "gemm", "decision": {"blocking": blocking}}}
    for c in dconvs:
        records[direct_key(c.desc)] = {"kind": "conv", "decision": {"form": "row", "threads": 2 if c.inline else 1}}
    db.write(str(tmp_path / "tuning.json"), records)
    exe, out = _run(tmp_path)
    (rows2,) = _by_kind(exe, "CompiledConvRows")
    assert all(getattr(rows2.blocking, f) == v for f, v in blocking.items()) and rows2.layout != rows.layout
    assert rows2.engine is not rows.engine
    d2 = _by_kind(exe, "CompiledDirectConv")
    assert [flat_form(c.desc) for c in d2] == [False] * 3
    assert [c.inline for c in d2] == [not c.inline for c in dconvs]
    assert plan_steps(exe) != plan_steps(untuned)
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_the_tuner_times_conv_candidates_and_the_plan_replays(tmp_path, monkeypatch):
    import apollo_py.tuning.tuner as T
    from apollo_py.tuning import tune
    monkeypatch.setattr(T, "MIN_GAIN", -1e9)      # every candidate wins: the rounds and replay are what is tested
    monkeypatch.setattr(T, "SLOWER_ROUND", 1e9)
    monkeypatch.setattr(T, "_ab_ratio", lambda *a, **k: 2.0)
    monkeypatch.setattr(T.load, "MAX_OTHERS_SHARE", 1e9)
    monkeypatch.setattr(T, "TILE_CANDIDATES", ())
    monkeypatch.setattr(T, "PARTS_CANDIDATES", ())
    monkeypatch.setattr(T, "KERNEL_ROUNDS", ())
    monkeypatch.setattr(T, "GEMM_ROUNDS", ("nc-",))
    monkeypatch.setattr(T, "GEMM_MIN_SHARE", 0.0)
    opts = ap.Options(cache_dir=str(tmp_path), machine="dev-2core", num_threads=2)
    res = tune(_model(), options=opts, feeds={"x": X}, budget=60, repeat=2, progress=False)
    changed = res.changed
    assert {k.split(":")[0] for k in changed} >= {"gemm", "conv"}, changed
    assert any("nc_max" in d.get("blocking", {}) for d in changed.values()), changed
    assert any(d.get("threads") for k, d in changed.items() if k.startswith("conv:")), changed
    exe, out = _run(tmp_path)
    assert plan_steps(exe) == res.plan_steps
    _, want = _run(tmp_path, tune="off")
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
