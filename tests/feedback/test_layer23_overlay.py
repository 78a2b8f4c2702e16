"""Overlay entries for layer-2/3 refusals: ``stitch_rejected`` -> ``[[no_stitch]]``,
``parallel_rejected`` -> ``[[no_parallel]]`` (feedback/overlay.py).  The next compile follows
them: the same kernels and launches, the same numbers, and the refusal is neither tried nor
logged again."""
import numpy as np

import apollo_py as ap
from apollo_py.feedback import apply, read_events
from apollo_py.layers import layer3, lowering
from apollo_py.partition.rules import overlay_signatures


def _softmax():
    b = ap.GraphBuilder("sm")
    x = b.input("x", (64, 256))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)])


def test_rejected_stitch_becomes_no_stitch_and_is_not_tried_again(tmp_path, monkeypatch):
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    # a small isl budget: layer 1 splits the stitched softmax, so layer 2's stitch is refused
    log1, log2, overlay = tmp_path / "1.jsonl", tmp_path / "2.jsonl", str(tmp_path / "o.toml")
    opts = ap.Options(cache_dir=str(tmp_path), schedule_budget=2000, machine="dev-2core")
    f1 = ap.jit(_softmax(), options=opts.replace(feedback_path=str(log1)))
    y1 = f1(x=x)
    rejected = {e["signature"] for e in read_events(str(log1), "stitch_rejected")}
    assert rejected
    res = apply(str(log1), overlay)
    assert overlay_signatures(overlay, "no_stitch") == rejected
    assert {a["event"] for a in res.added} >= {"stitch_rejected", "schedule_budget_exceeded"}
    whole = []
    real = lowering.fuse_nodes

    def counting(nodes, *a, **k):
        whole.append(len(nodes))
        return real(nodes, *a, **k)
    monkeypatch.setattr(lowering, "fuse_nodes", counting)
    f2 = ap.jit(_softmax(), options=opts.replace(feedback_path=str(log2), rules_overlay=overlay))
    y2 = f2(x=x)
    assert not log2.exists() or read_events(str(log2)) == []      # nothing refused, nothing logged
    assert whole and max(whole) < 5         # the five-node stitch group never went to layer 1
    assert [k.to_dict()["ops"] for k in f2.plan.kernels] == [k.to_dict()["ops"] for k in f1.plan.kernels]
    np.testing.assert_array_equal(y2, y1)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y2, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


def _branches(n=4, shape=(1024, 1024)):
    b = ap.GraphBuilder("branches")
    return b.build([b.reduce_sum(b.exp(b.input(f"x{i}", shape)), axes=(1,), keepdims=True) for i in range(n)])


def test_rejected_parallel_combination_becomes_no_parallel(tmp_path, monkeypatch):
    real = layer3.stitch_parallel
    # a policy demanding a one-second gain: every combination is tried and refused
    monkeypatch.setattr(layer3, "stitch_parallel", lambda ks, m, on_reject=None, **kw: real(
        ks, m, layer3.ParallelPolicy(min_gain=1.0), on_reject=on_reject, **kw))
    xs = {f"x{i}": np.full((1024, 1024), 0.1 * i, np.float32) for i in range(4)}
    machine = ap.Machine(bandwidth=100e9, peak=500e9, launch=1e-9)
    log1, log2, overlay = tmp_path / "1.jsonl", tmp_path / "2.jsonl", str(tmp_path / "o.toml")

    def run(log, **kw):
        f = ap.jit(_branches(), options=ap.Options(cache_dir=str(tmp_path), machine=machine,
                                                     feedback_path=str(log), **kw))
        ys = f.run(**xs)
        exe = f.specialization({k: (1024, 1024) for k in xs})
        return ys, [len(item) for kind, item in exe._schedule if kind == "kernels"]
    y1, groups1 = run(log1)
    rejected = {e["signature"] for e in read_events(str(log1), "parallel_rejected")}
    assert len(rejected) == 3       # 4, 3 and 2 kernels tried; each refused
    apply(str(log1), overlay)
    assert overlay_signatures(overlay, "no_parallel") == rejected
    y2, groups2 = run(log2, rules_overlay=overlay)
    assert groups2 == groups1 == [1, 1, 1, 1]
    assert not log2.exists() or read_events(str(log2), "parallel_rejected") == []
    for a, b in zip(y1, y2):
        np.testing.assert_array_equal(a, b)
    # without the policy the combination would be taken: the overlay still refuses it
    monkeypatch.setattr(layer3, "stitch_parallel", real)
    _, groups3 = run(tmp_path / "3.jsonl", rules_overlay=overlay)
    _, groups4 = run(tmp_path / "4.jsonl")
    assert groups4 == [4] and groups3 == [1, 1, 1, 1]
