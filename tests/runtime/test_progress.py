"""Progress lines on long compiles: silent when short or disabled, stage counts when long."""
import io

import apollo_py as ap
from apollo_py import progress as P


def _graph():
    b = ap.GraphBuilder("prog")
    x = b.input("x", (16, 32))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    return b.build([b.tanh(e / b.reduce_sum(e, axes=(1,), keepdims=True))])


def test_short_compile_is_silent():
    out = io.StringIO()
    p = P.Progress("m", True, after_s=60.0, stream=out)
    p.stage("layer 1 fusion", 3)
    p.step(3)
    p.done()
    assert out.getvalue() == ""


def test_disabled_is_silent_and_auto_is_off_for_a_pipe():
    out = io.StringIO()
    p = P.Progress("m", False, after_s=0.0, every_s=0.0, stream=out)
    p.stage("x", 1)
    p.step()
    p.done()
    assert out.getvalue() == ""
    assert P.Progress("m", None, stream=io.StringIO()).enabled is False


def test_long_compile_reports_stages(monkeypatch, capsys):
    monkeypatch.setattr(P, "AFTER_S", 0.0)
    monkeypatch.setattr(P, "EVERY_S", 0.0)
    ap.jit(_graph(), options=ap.Options(target="cpu", progress=True)).plan
    err = capsys.readouterr().err.splitlines()
    assert any("compiling prog: layer 1 fusion" in ln for ln in err), err
    assert any("compiling prog: LLVM codegen" in ln for ln in err), err
    assert err[-1].startswith("apollo_py: compiled prog in ")


def test_plan_records_where_the_compile_time_went():
    import numpy as np
    import apollo_py as ap
    b = ap.GraphBuilder("t")
    x = b.input("x", (8, 32))
    g = b.build([b.exp(x) / b.reduce_sum(b.exp(x), axes=(1,), keepdims=True)])
    for target, stages in (("cpu", ["preprocess", "partition", "layer 1 fusion", "LLVM codegen", "GEMM codegen"]),
                           ("reference", ["preprocess", "partition"])):
        f = ap.jit(g, target=target)
        f(np.ones((8, 32), np.float32))
        assert [s for s, _ in f.plan.timings] == stages
        assert all(t >= 0 for _, t in f.plan.timings)
        assert "compile time: preprocess" in str(f.plan)
