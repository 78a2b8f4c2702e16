"""Scheduling that never hangs: the isl scheduler runs under a wall-time limit in a child
process that is killed when over (poly/bounded.py); layer 1 then logs the refusal and splits."""
import os
import time

import numpy as np
import pytest

import graphs
from apollo_py.feedback.log import default_log_path, read_events
from apollo_py.layers.layer1 import fuse_micro_graph
from apollo_py.options import Options
from apollo_py.poly.bounded import ChildError, WallTimeExceeded, run_bounded
from apollo_py.runtime.reference import evaluate

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="wall-time limits need os.fork")


def test_child_result_error_and_timeout():
    big = "x" * (3 << 20)                       # more than one pipe buffer
    assert run_bounded(lambda: big, 10) == big
    with pytest.raises(ChildError) as e:
        run_bounded(lambda: 1 / 0, 10)
    assert e.value.kind == "ZeroDivisionError"
    t = time.perf_counter()
    with pytest.raises(WallTimeExceeded):
        run_bounded(lambda: time.sleep(60) or "", 0.3)
    assert time.perf_counter() - t < 5
    assert run_bounded(lambda: "in-process", None) == "in-process"


def _hanging_scheduler(monkeypatch):
    """Direct construction refused and isl's scheduler that never returns, as on the GPT-2
    export's masked attention before (15 minutes in compute_schedule)."""
    import apollo_py.poly.schedule as S

    def refuse(prog, deps):
        raise S.NotOneGroup("refused for the test")

    def hang(prog, deps):
        if len(prog.statements) > 2:            # a single primitive still schedules
            time.sleep(3600)
        return real(prog, deps)
    real = S.isl_schedule
    monkeypatch.setattr(S, "build_fused_schedule", refuse)
    monkeypatch.setattr(S, "isl_schedule", hang)


def test_hanging_scheduler_is_stopped_split_and_logged(tmp_path, monkeypatch):
    _hanging_scheduler(monkeypatch)
    g = graphs.softmax(8, 40)
    opts = Options(cache_dir=str(tmp_path), schedule_timeout=0.3)
    t = time.perf_counter()
    ks = fuse_micro_graph(list(g.nodes), g.types, list(g.inputs), list(g.outputs), opts)
    took = time.perf_counter() - t
    events = read_events(default_log_path(opts), "schedule_budget_exceeded")
    assert events and all("wall-time" in e["detail"]["error"] for e in events)
    # every split level pays at most one timeout: 7 statements -> pieces of <= 2 statements
    assert len(ks) >= 2 and took < 0.3 * len(events) + 10
    from test_layer1 import _run
    _run(g, ks)
