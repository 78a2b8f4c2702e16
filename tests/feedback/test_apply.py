"""`feedback apply` / `revert` (apollo_py/feedback/overlay.py): refusals in the log become
``[[split]]`` entries of a versioned rule overlay that the next compile follows."""
import subprocess
import sys

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import FeedbackError, RuleError
from apollo_py.feedback import apply, read_events, revert, revisions
from apollo_py.feedback.log import log_event
from apollo_py.layers import fuse_memo
from apollo_py.partition.rules import load_rules, relevant_splits, split_signatures
from apollo_py.runtime.reference import evaluate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _graph():
    b = ap.GraphBuilder("budget")
    x = b.input("x", (16, 32))
    bias = b.input("b", (32,))
    y = b.tanh(b.exp(x + bias) * 0.5)
    s = b.reduce_sum(y, axes=(1,), keepdims=True)
    return b.build([y - s])


def _feeds():
    rng = np.random.default_rng(2)
    return {"x": rng.standard_normal((16, 32)).astype(np.float32),
            "b": rng.standard_normal(32).astype(np.float32)}


def _budget_events(path):
    return [e for e in read_events(str(path)) if e["event"] == "schedule_budget_exceeded"]


def test_apply_splits_up_front_next_compile_logs_no_budget_event(tmp_path):
    g, feeds = _graph(), _feeds()
    log, overlay = tmp_path / "fb.jsonl", tmp_path / "overlay.toml"
    opts = ap.Options(schedule_budget=50, feedback_path=str(log), cache_dir=str(tmp_path), model_name="budget")
    first = ap.jit(g, options=opts)(**feeds)
    refused = {e["signature"] for e in _budget_events(log)}
    assert refused, "a budget of 50 isl operations must refuse this pattern"

    dry = apply(str(log), str(overlay), dry_run=True)
    assert dry.revision is None and not overlay.exists()
    assert "+[[split]]" in dry.diff and "+revision = 1" in dry.diff

    res = apply(str(log), str(overlay))
    assert res.revision == 1 and {a["signature"] for a in res.added if a["event"] == "schedule_budget_exceeded"} \
        == refused
    stitched = {e["signature"] for e in read_events(str(log), "stitch_rejected")}   # [[no_stitch]] entries
    assert {a["signature"] for a in res.added if a["event"] == "stitch_rejected"} == stitched
    doc = tomllib.loads(overlay.read_text())
    assert doc["revision"] == 1
    for entry in doc["split"]:
        assert entry["event"] == "schedule_budget_exceeded" and "budget 50" in entry["reason"]
        assert entry["evidence"]["events"] >= 1 and entry["evidence"]["models"] == ["budget"]
        assert entry["evidence"]["budget"] == [50] and entry["date"].startswith("20")
    assert split_signatures(str(overlay)) == frozenset(refused)
    load_rules(str(overlay))                       # the overlay passes the partition schema

    log2 = tmp_path / "fb2.jsonl"
    f2 = ap.jit(g, options=opts.replace(rules_overlay=str(overlay), feedback_path=str(log2)))
    second = f2(**feeds)
    assert _budget_events(log2) == []
    np.testing.assert_array_equal(second, first)
    np.testing.assert_allclose(second, evaluate(g, feeds)[0], rtol=1e-5, atol=1e-5)

    again = apply(str(log), str(overlay))          # nothing new: no new revision
    assert again.revision is None and again.added == [] and revisions(str(overlay)) == [1]


def _two_patterns():
    b = ap.GraphBuilder("two")
    x = b.input("x", (16, 32))
    bias = b.input("b", (32,))
    y = b.tanh(b.exp(x + bias) * 0.5)
    s = b.reduce_sum(y, axes=(1,), keepdims=True)
    h = b.reduce_max(x, axes=(0,), keepdims=False)
    return b.build([y - s, b.sqrt(h * h + 1.0)])


def test_overlay_entry_recompiles_only_the_pieces_it_can_touch(tmp_path, monkeypatch):
    g, feeds = _two_patterns(), _feeds()
    opts = ap.Options(cache_dir=str(tmp_path), machine="dev-2core")
    ap.jit(g, options=opts)(**feeds)
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('version = 1\n[[split]]\nsignature = "tanh:ew($0) reduce_sum:red(0)"\n')
    assert relevant_splits(["add", "exp", "mul", "tanh", "reduce_sum"], str(overlay)) == (
        "tanh:ew($0) reduce_sum:red(0)",)
    assert relevant_splits(["sub"], str(overlay)) == ()
    monkeypatch.setattr(fuse_memo, "_MEMO", type(fuse_memo._MEMO)(fuse_memo._MEMO.maxsize))
    fused = []
    real = fuse_memo.fuse_micro_graph

    def counting(nodes, *a, **k):
        fused.append({n.op for n in nodes})
        return real(nodes, *a, **k)
    monkeypatch.setattr(fuse_memo, "fuse_micro_graph", counting)
    out = ap.jit(g, options=opts.replace(rules_overlay=str(overlay)))(**feeds)
    # only pieces holding both tanh and reduce_sum are fused again; the other three come
    # from the store (their keys do not change)
    assert fused and all({"tanh", "reduce_sum"} <= ops for ops in fused), fused
    for got, want in zip(out, evaluate(g, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_revert_restores_a_revision_and_names_the_known_ones(tmp_path):
    opts = ap.Options(cache_dir=str(tmp_path))
    log, overlay = str(tmp_path / "fb.jsonl"), str(tmp_path / "o.toml")
    log_event(opts, "schedule_budget_exceeded", "exp:ew($0)", time_ms=1.0, detail={"budget": 50}, path=log)
    assert apply(log, overlay).revision == 1
    log_event(opts, "multiple_fusion_groups", "mul:ew($0,$1) tanh:ew(0)", time_ms=2.0, path=log)
    log_event(opts, "stitch_rejected", "sub:bc($0,$1)", path=log)          # a [[no_stitch]] entry
    res = apply(log, overlay)
    assert res.revision == 2 and sorted(a["signature"] for a in res.added) == ["mul:ew($0,$1) tanh:ew(0)",
                                                                                "sub:bc($0,$1)"]
    assert split_signatures(overlay) == {"exp:ew($0)", "mul:ew($0,$1) tanh:ew(0)"}
    revert(overlay, 1)
    assert split_signatures(overlay) == {"exp:ew($0)"}
    revert(overlay, 0)
    assert split_signatures(overlay) == frozenset()
    with pytest.raises(FeedbackError, match=r"no revision 7; revisions are \[1, 2\]"):
        revert(overlay, 7)
    with pytest.raises(FeedbackError, match="does not exist"):
        apply(str(tmp_path / "missing.jsonl"), overlay)
    (tmp_path / "bad.toml").write_text('version = 1\n[[split]]\nsignature = "x"\nwhat = 1\n')
    with pytest.raises(RuleError, match="unknown key"):
        split_signatures(str(tmp_path / "bad.toml"))


def test_cli_feedback_apply_dry_run_and_revert(tmp_path):
    opts = ap.Options(cache_dir=str(tmp_path))
    log_event(opts, "schedule_budget_exceeded", "exp:ew($0)", time_ms=1.0, detail={"budget": 50})

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "apollo_py.cli", "--cache-dir", str(tmp_path), *args],
                              capture_output=True, text=True)
    r = cli("feedback", "apply", "--dry-run")
    assert r.returncode == 0 and '+signature = "exp:ew($0)"' in r.stdout and "dry run" in r.stdout
    assert not (tmp_path / "rules_overlay.toml").exists()
    r = cli("feedback", "apply")
    assert r.returncode == 0 and "revision 1" in r.stdout
    assert split_signatures(str(tmp_path / "rules_overlay.toml")) == {"exp:ew($0)"}
    r = cli("feedback", "revert", "3")
    assert r.returncode == 2 and "no revision 3" in r.stderr
    r = cli("feedback", "revert", "0")
    assert r.returncode == 0 and split_signatures(str(tmp_path / "rules_overlay.toml")) == frozenset()
