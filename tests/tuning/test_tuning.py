"""Auto-tuning with stored decisions (apollo_py/tuning/): the tuner stores per-piece decisions
for this machine; a later compile (a new process) replays them without timing anything; a
database of another machine is ignored; decisions never change the numbers."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import OptionsError
from apollo_py.layers.lowering import lowering_groups, stitch_key
from apollo_py.layers.layer2 import stitch_groups
from apollo_py.tuning import db, tune
from apollo_py.tuning.tuner import plan_steps, tune_graph

MACHINE = "dev-2core"       # pinned: the replayed plan's chunking must not depend on a re-measure


def _graph():
    """A softmax (a layer-2 stitch group), a weight matmul with a bias epilogue (BLAS or the
    generated GEMM) and two independent branches (a layer-3 run)."""
    rng = np.random.default_rng(0)
    b = ap.GraphBuilder("tunable")
    x = b.input("x", (64, 256))
    w = b.constant(rng.standard_normal((256, 64)).astype(np.float32))
    m = b.reduce_max(x, axes=(1,), keepdims=True)
    e = b.exp(x - m)
    sm = e / b.reduce_sum(e, axes=(1,), keepdims=True)
    y = b.tanh(b.matmul(sm, w))
    u = b.input("u", (512, 256))
    v = b.input("v", (512, 256))
    return b.build([y, b.reduce_sum(b.exp(u), axes=(1,)), b.reduce_sum(b.sqrt(b.abs(v)), axes=(1,))])


def _feeds():
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((64, 256)).astype(np.float32),
            "u": rng.standard_normal((512, 256)).astype(np.float32),
            "v": rng.standard_normal((512, 256)).astype(np.float32)}


def _opts(tmp_path, **kw):
    return ap.Options(cache_dir=str(tmp_path), machine=MACHINE, **kw)


def _exe(opts):
    f = ap.jit(_graph(), options=opts)
    out = f.run(**_feeds())
    return f.specialization({k: a.shape for k, a in _feeds().items()}), out


def test_options_check_the_tuning_fields():
    with pytest.raises(OptionsError, match="Options.tune must be one of"):
        ap.Options(tune="yes")
    with pytest.raises(OptionsError, match="tune_budget"):
        ap.Options(tune_budget=0)


def _gemm_step(exe):
    """The graph's generated GEMM step (the weight matmul with its tanh epilogue)."""
    steps = [s for s in exe.steps if getattr(getattr(s, "compiled", None), "blocking", None) is not None]
    assert len(steps) == 1, [type(s).__name__ for s in exe.steps]
    return steps[0]


def test_tuning_stores_decisions_a_new_process_replays_them_without_timing(tmp_path, monkeypatch):
    import apollo_py.tuning.tuner as T
    # every candidate wins and the whole is kept: the plan replayed below then has a
    # non-default decision of every kind the graph offers (a GEMM blocking among them),
    # whatever this box's timings are (the selection itself: test_options_tune_...)
    monkeypatch.setattr(T, "MIN_GAIN", -1e9)
    monkeypatch.setattr(T, "SLOWER_ROUND", 1e9)
    monkeypatch.setattr(T, "_ab_ratio", lambda *a, **k: 2.0)
    monkeypatch.setattr(T.load, "MAX_OTHERS_SHARE", 1e9)      # the shared box may be busy: store anyway
    monkeypatch.setattr(T, "TRY_BLAS", False)       # keep the generated GEMM (its flip: test_blas_flip_...)
    # one candidate of each kind is enough to replay (the full lists: test_gemm_candidates_...)
    monkeypatch.setattr(T, "TILE_CANDIDATES", ((16,),))
    monkeypatch.setattr(T, "PARTS_CANDIDATES", (1,))
    monkeypatch.setattr(T, "GEMM_ROUNDS", ("threads", "mr", "kc-"))
    opts = _opts(tmp_path)
    res = tune(_graph(), options=opts, feeds=_feeds(), budget=20, repeat=2, progress=False)
    assert res.tuned_s > 0 and res.default_s > 0 and os.path.exists(res.db)
    doc = json.load(open(res.db))
    pieces = doc["machines"][db.machine_key()]["pieces"]
    assert set(pieces) == set(res.records)
    kinds = {r["kind"] for r in pieces.values()}
    assert {"stitch", "group", "kernel", "gemm"} <= kinds, kinds
    assert {"stitch", "group", "kernel", "gemm"} <= {r["kind"] for r in pieces.values() if r["decision"]}
    gemm = [r for r in pieces.values() if r["kind"] == "gemm"]
    assert len(gemm) == 1 and gemm[0]["decision"] == {"threads": 2, "blocking": {"mr": 12, "kc": 128}}, gemm
    from apollo_py.tuning.kernels import host_vector_width
    if host_vector_width() == 512:      # a kernel code decision, replayed below (plan_steps has the width)
        assert any(r["decision"].get("vector_width") == 256 for r in pieces.values() if r["kind"] == "kernel")
    exe, _ = _exe(opts.replace(tune="off"))
    _, _, keys = lowering_groups(exe.plan.graph, exe.plan.micro_graphs, opts, db.decisions(opts), with_keys=True)
    assert set(keys) <= set(pieces)     # every lowering group (under the stored stitch decisions) has a decision
    for r in pieces.values():
        assert r["tuned_s"] in r["candidates"].values()
    events = [json.loads(line) for line in open(tmp_path / "feedback.jsonl")]
    tuned_events = [e for e in events if e["event"] == "tuning_result"]
    assert len(tuned_events) == len(res.records)
    # measured vs predicted for every piece the profile times (kernel, run and GEMM pieces too)
    assert all(e["detail"]["predicted_ms"] > 0 for e in tuned_events), tuned_events
    assert json.load(open(tmp_path / "cost_corrections.json"))["machines"][db.machine_key()]["factors"]
    # a new process: every timing function fails, the plan is the tuned one, numbers the untuned ones
    (tmp_path / "want.json").write_text(json.dumps(res.plan_steps))
    np.savez(tmp_path / "untuned.npz", *_exe(opts.replace(tune="off"))[1])
    script = f"""
import json, sys, numpy as np
sys.path.insert(0, {os.path.dirname(__file__)!r})
import apollo_py.runtime.profile as P, apollo_py.tuning.tuner as T, apollo_py.machine as M
def fail(*a, **k):
    raise AssertionError("timed something while replaying")
P.profile_executable = T.profile_executable = T.tune_graph = T._Measurement = M.measure_machine = fail
import test_tuning as t
exe, out = t._exe(t._opts({str(tmp_path)!r}))
assert T.plan_steps(exe) == json.load(open({str(tmp_path / 'want.json')!r})), T.plan_steps(exe)
bl = t._gemm_step(exe).compiled.blocking
assert all(getattr(bl, f) == v for f, v in {gemm[0]['decision']['blocking']!r}.items()), bl
want = np.load({str(tmp_path / 'untuned.npz')!r})
for k, a in enumerate(out):
    np.testing.assert_allclose(a, want[f"arr_{{k}}"], rtol=1e-5, atol=1e-6)
print("replayed")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "replayed" in r.stdout, r.stderr[-3000:]


def _decisions(tmp_path):
    """Non-default decisions for every kind of piece of the graph (stitch, tiles, GEMM, chunks,
    layer 3), keyed as the compiler keys them."""
    exe, _ = _exe(_opts(tmp_path, tune="off"))
    g, mgs = exe.plan.graph, exe.plan.micro_graphs
    out = {stitch_key(s, mgs, g.types): {"stitch": False} for s in stitch_groups(mgs, g.types) if len(s) > 1}
    assert out, "the softmax should be a stitch group"
    no_stitch = {k: v for k, v in out.items()}
    groups, _, keys = lowering_groups(g, mgs, _opts(tmp_path), no_stitch)
    for key, grp in zip(keys, groups):
        ops = {n.op for k in grp for n in mgs[k].nodes}
        out[key] = {"gemm": "blas"} if "matmul" in ops else {"tiles": [16]}
    from apollo_py.runtime.cpu import KernelStep
    for s in exe.steps:
        if isinstance(s, KernelStep) and (s.compiled.parallel_extent or 0) > 1:
            out[db.kernel_key(s.fused, g.types)] = {"parts": 1}
    for run in exe.runs:
        out[db.run_key([db.kernel_key(s.fused, g.types) for s in run])] = {"layer3": "separate"}
    return exe, out


def test_stored_decisions_change_the_plan_not_the_numbers(tmp_path):
    untuned, decisions = _decisions(tmp_path)
    db.write(str(tmp_path / "tuning.json"), {k: {"kind": k.split(":")[0], "decision": d}
                                            for k, d in decisions.items()})
    exe, out = _exe(_opts(tmp_path))
    kinds = [k.to_dict()["kind"] for k in exe.plan.kernels]
    assert "gemm" in [k.to_dict()["kind"] for k in untuned.plan.kernels] and "gemm" not in kinds
    assert len(exe.plan.kernels) > len(untuned.plan.kernels)        # the softmax unstitched
    assert any(tuple(k.fused.tile_sizes) == (16,) for k in exe.steps if getattr(k, "fused", None) is not None)
    assert all(len(item) == 1 for kind, item in exe._schedule if kind == "kernels")
    _, want = _exe(_opts(tmp_path, tune="off"))
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_tuned_gemm_blocking_changes_the_compiled_gemm_not_the_numbers(tmp_path):
    from apollo_py.runtime.gemm_step import gemm_key
    untuned, want = _exe(_opts(tmp_path, tune="off"))
    step = _gemm_step(untuned)
    assert step.compiled.inline and step.compiled.blocking.mr == 8      # 64 x 64 x 256: one thread
    decision = {"blocking": {"mr": 12, "nr": 16, "kc": 128, "direct_a": False}, "threads": 2}
    db.write(str(tmp_path / "tuning.json"), {gemm_key(step.compiled.desc): {"kind": "gemm", "decision": decision}})
    exe, out = _exe(_opts(tmp_path))
    cg = _gemm_step(exe).compiled
    assert (cg.blocking.mr, cg.blocking.nr, cg.blocking.kc) == (12, 16, 128)
    assert not cg.inline and not cg.layout.direct_a and cg.layout.nkc == 2
    # another blocking is another compiled module (compile_module's key is the rendered
    # descriptor, blocking and layout), and another model-cache key (db.digest)
    assert cg.engine is not step.compiled.engine and db.digest(_opts(tmp_path))
    assert plan_steps(exe) != plan_steps(untuned)
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # 8-wide vectors (the vl candidate, AVX-512 hosts): another module, the same numbers
    db.write(str(tmp_path / "tuning.json"), {gemm_key(step.compiled.desc): {
        "kind": "gemm", "decision": {"blocking": {"vl": 8, "nr": 16}}}})
    exe, out = _exe(_opts(tmp_path))
    cg = _gemm_step(exe).compiled
    assert (cg.blocking.vl, cg.blocking.nr) == (8, 16) and "<8 x float>" in cg.ir
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # a field this version does not know, or an nr the micro-kernel cannot take: the default
    db.write(str(tmp_path / "tuning.json"), {gemm_key(step.compiled.desc): {
        "kind": "gemm", "decision": {"blocking": {"nr": 24, "wide": 3}}}})
    assert _gemm_step(_exe(_opts(tmp_path))[0]).compiled.blocking == step.compiled.blocking
    db.write(str(tmp_path / "tuning.json"), {gemm_key(step.compiled.desc): {
        "kind": "gemm", "decision": {"blocking": {"kc": 0}}}})
    assert _gemm_step(_exe(_opts(tmp_path))[0]).compiled.blocking == step.compiled.blocking


def test_gemm_candidates_change_the_code_or_tiles():
    """Every candidate the tuner offers for a GEMM compiles to other tiles or code than the
    current decision (no round times the same GEMM twice)."""
    from apollo_py.codegen.gemm import conv_desc, default_blocking, layout, matmul_desc
    from apollo_py.runtime.gemm_step import tuned_blocking
    from apollo_py.tuning.space import GEMM_ROUNDS, gemm_candidates
    mm = matmul_desc("mm", (384, 512), (512, 768), (384, 768), "y")
    conv = conv_desc("cv", (1, 256, 14, 14), (256, 256, 3, 3), (1, 256, 14, 14),
                     {"group": 1, "strides": (1, 1), "pads": (1, 1, 1, 1), "dilations": (1, 1)}, "y")
    for d in (mm, conv):
        cands = gemm_candidates(d, {}, 2)
        assert {"threads", "mr", "nr", "kc-", "kc+"} <= set(cands) <= set(GEMM_ROUNDS), cands
        if default_blocking(d).vl == 16:    # AVX-512: 8-wide vectors (N 196: 8 columns pad to 200, not 208)
            assert cands["vl"]["blocking"] == {"vl": 8, "nr": 16 if d is mm else 8}, cands["vl"]
        base = default_blocking(d), layout(d, default_blocking(d), 2)
        for label, dec in cands.items():
            bl, one = tuned_blocking(d, dec)
            if label == "threads":
                assert bl is None and one is True
                continue
            assert bl is not None and (bl, layout(d, bl, 2)) != base, label
            assert (bl.mr, bl.nr, bl.vl) != (base[0].mr, base[0].nr, base[0].vl) or layout(d, bl, 2) != base[1], label
    # coordinate descent: a candidate keeps what the piece has won so far
    assert gemm_candidates(mm, {"blocking": {"kc": 128}}, 2)["mr"]["blocking"]["kc"] == 128
    assert "threads" not in gemm_candidates(mm, {}, 1)


def test_a_database_of_another_machine_is_ignored(tmp_path):
    untuned, decisions = _decisions(tmp_path)
    records = {k: {"kind": k.split(":")[0], "decision": d} for k, d in decisions.items()}
    db.write(str(tmp_path / "tuning.json"), records, key="another-machine")
    assert db.decisions(_opts(tmp_path)) == {}
    exe, _ = _exe(_opts(tmp_path))
    assert plan_steps(exe) == plan_steps(untuned)
    db.write(str(tmp_path / "tuning.json"), records)            # the same under this machine's key
    assert db.decisions(_opts(tmp_path)) and plan_steps(_exe(_opts(tmp_path))[0]) != plan_steps(untuned)
    assert db.decisions(_opts(tmp_path, tune="off")) == {}


def test_cli_tune_reports_and_stores(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 128])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Tanh", ["e"], ["y"])]
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(helper.make_graph(nodes, "small", [x], [y]),
                                opset_imports=[helper.make_opsetid("", 17)]), path)
    from apollo_py.cli import main
    assert main(["--cache-dir", str(tmp_path), "tune", path, "--budget", "5", "--repeat", "2"]) == 2
    assert "--shape x=D0,D1" in capsys.readouterr().err
    # a budget of one round: the command's parsing, report and database (the rounds: the tests above)
    assert main(["--cache-dir", str(tmp_path), "tune", path, "--shape", "x=256,128", "--budget", "0.01",
                 "--repeat", "2", "--json", "--progress", "off"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] and out["db"] == str(tmp_path / "tuning.json") and os.path.exists(out["db"])


def test_options_tune_tunes_on_first_call_then_replays(tmp_path, monkeypatch):
    opts = _opts(tmp_path, tune="tune", tune_budget=3.0)
    f = ap.jit(_graph(), options=opts)
    f.run(**_feeds())
    assert db.decisions(opts), "the first call at a shape tunes and stores decisions"
    pieces = json.load(open(tmp_path / "tuning.json"))["machines"][db.machine_key()]["pieces"]
    for r in pieces.values():       # a piece keeps its default unless a candidate was faster
        assert r["tuned_s"] <= r["default_s"] + 1e-12 and "candidates" in r
    import apollo_py.tuning.tuner as T

    def fail(*a, **k):
        raise AssertionError("tuned again although every piece has a decision")
    monkeypatch.setattr(T, "tune_graph", fail)
    out = ap.jit(_graph(), options=opts).run(**_feeds())
    _, want = _exe(_opts(tmp_path, tune="off"))
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cost_corrections_recalibrate_layer3(tmp_path):
    """A kernel correction factor (measured / predicted) rescales layer 3's cost model: four
    branches predicted to fill the machine alone at 100 kB/s are grouped once the tuner found
    kernels a million times faster than that prediction."""
    b = ap.GraphBuilder("branches")
    g = b.build([b.reduce_sum(b.exp(b.input(f"x{i}", (1024, 1024))), axes=(1,), keepdims=True) for i in range(4)])
    xs = {f"x{i}": np.full((1024, 1024), 0.1 * i, np.float32) for i in range(4)}
    machine = ap.Machine(bandwidth=1e5, peak=50e9, launch=1e-6)

    def groups(**kw):
        f = ap.jit(g, options=ap.Options(cache_dir=str(tmp_path), machine=machine, **kw))
        f.run(**xs)
        exe = f.specialization({k: (1024, 1024) for k in xs})
        return [len(item) for kind, item in exe._schedule if kind == "kernels"]
    assert groups() == [1, 1, 1, 1]
    db.write_corrections(ap.Options(cache_dir=str(tmp_path)), {"kernel": 1e-6}, {"kernel": 4})
    assert groups() == [4]
    assert groups(tune="off") == [1, 1, 1, 1]       # "off" ignores the corrections too


def test_decisions_timed_on_a_busy_machine_are_refused(tmp_path, monkeypatch):
    """Other processes held the cores while the tuner timed (here: any share counts as too
    much): no decision is stored, the pieces keep the defaults, the records say why and carry
    the load, and a warning says it; ``allow_load=True`` stores them anyway."""
    import apollo_py.tuning.tuner as T
    monkeypatch.setattr(T, "MIN_GAIN", -1e9)
    monkeypatch.setattr(T, "SLOWER_ROUND", 1e9)
    monkeypatch.setattr(T, "_ab_ratio", lambda *a, **k: 2.0)
    monkeypatch.setattr(T, "TILE_CANDIDATES", ())
    monkeypatch.setattr(T, "PARTS_CANDIDATES", (1,))
    monkeypatch.setattr(T, "GEMM_ROUNDS", ("threads",))
    monkeypatch.setattr(T.load, "MAX_OTHERS_SHARE", -1.0)
    opts = _opts(tmp_path)
    with pytest.warns(RuntimeWarning, match="none were stored"):
        res = tune(_graph(), options=opts, feeds=_feeds(), budget=20, repeat=2, progress=False)
    assert res.refused and "tune again on a quiet machine" in res.refused and not res.changed and res.rejected
    pieces = json.load(open(res.db))["machines"][db.machine_key()]["pieces"]
    assert pieces and all(r["decision"] == {} and r["refused"] for r in pieces.values())
    ev = next(iter(pieces.values()))["load"]
    assert ev["others_share"] is not None and ev["cpus"] >= 1 and len(ev["loadavg"]) == 2
    assert "NOT STORED" in res.summary()
    res = tune(_graph(), options=opts, feeds=_feeds(), budget=20, repeat=2, progress=False, allow_load=True)
    assert not res.refused and res.changed
    assert all("refused" not in r for r in json.load(open(res.db))["machines"][db.machine_key()]["pieces"].values())


def test_the_load_window_counts_other_processes_not_this_one():
    """A busy process that is not this one (nor a child it waited for) shows in
    ``others_share``."""
    import time
    from apollo_py.tuning import load as L
    if L._cpu_busy() is None:
        pytest.skip("no /proc/stat")
    total = os.cpu_count() or 1
    w = L.start()
    # a grandchild (the shell exits at once): its CPU time is not in this process's os.times()
    subprocess.run(["sh", "-c", f"{sys.executable} -c 'import time; t = time.time()\n"
                                "while time.time() - t < 1.5: pass' >/dev/null 2>&1 &"], check=True)
    time.sleep(1.6)
    ev = w.stop()
    assert ev["others_share"] >= 0.6 / total, ev
    assert L.too_busy({**ev, "others_share": 0.9}, 0.25) and not L.too_busy({**ev, "others_share": 0.1}, 0.25)


def test_blas_flip_is_confirmed_then_replayed(tmp_path, monkeypatch):
    """A generated -> BLAS flip that wins its round goes through the "blas confirm" round (a
    second paired look at the piece and the whole run) before it is stored; replayed, the
    matmul runs on BLAS with the same numbers."""
    import apollo_py.tuning.tuner as T
    from apollo_py.runtime.blas import BlasStep, cblas
    if cblas() is None:
        pytest.skip("no cblas next to numpy")
    monkeypatch.setattr(T, "MIN_GAIN", -1e9)
    monkeypatch.setattr(T, "SLOWER_ROUND", 1e9)
    monkeypatch.setattr(T, "_ab_ratio", lambda *a, **k: 2.0)
    monkeypatch.setattr(T.load, "MAX_OTHERS_SHARE", 1e9)
    monkeypatch.setattr(T, "TILE_CANDIDATES", ())
    monkeypatch.setattr(T, "PARTS_CANDIDATES", ())
    monkeypatch.setattr(T, "KERNEL_ROUNDS", ())
    monkeypatch.setattr(T, "GEMM_ROUNDS", ())
    assert T.TRY_BLAS
    opts = _opts(tmp_path)
    res = tune(_graph(), options=opts, feeds=_feeds(), budget=20, repeat=2, progress=False)
    assert "blas confirm" in [r[0] for r in res.rounds]
    flips = {k: r for k, r in res.records.items() if r["decision"].get("gemm") == "blas"}
    assert len(flips) == 1 and "blas confirm" in next(iter(flips.values()))["candidates"], res.records
    exe, out = _exe(opts)
    assert any(isinstance(s, BlasStep) for s in exe.steps)
    _, want = _exe(opts.replace(tune="off"))
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
