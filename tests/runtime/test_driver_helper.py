"""The driver's helper thread (codegen/driver.py ``apollo_help``, runtime/drive.py): a segment's
parallel steps (small generated GEMMs / direct convs) share their chunks with one pool worker
that joins the call.  Same numbers with and without it (bit for bit: chunks do not change the
arithmetic) and against onnxruntime; a helper that joins before the first step, or after the
call ended, neither hangs nor changes anything."""
import threading

import numpy as np
import pytest

import apollo_py
from apollo_py import Options
from apollo_py.codegen import driver as D
from apollo_py.runtime import drive

from ..conv.models import ort_run
from ..conv.test_inline_driver import _block

# 1x1 convs of 12-15 MFLOP: on the calling thread (under SMALL_CONV_FLOPS); depthwise convs moving
# 1-2 MiB: inline and worth a helper (HELPER_MIN_WORK).  Only the direct convs share chunks with
# the helper: a generated GEMM claims its tiles from a counter and runs as one call (gemm_ir.py)
CASES = {
    "28x28": dict(x_shape=(1, 32, 28, 28), expand=240, cout=32, k=3, stride=1),
    "odd_31x29_s2_k5_batch2": dict(x_shape=(2, 24, 31, 29), expand=144, cout=40, k=5, stride=2, act="Sigmoid"),
    "28x28_relu": dict(x_shape=(1, 40, 28, 28), expand=240, cout=40, k=3, stride=1, act="Relu"),
}


def _model(case="28x28"):
    kw = CASES[case]
    m = _block(**kw)
    x = np.random.default_rng(5).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    return m, x, f


def eager_helper(started: list):
    """A stand-in for ``drive._start_helper`` that resets the call's shared state, starts a
    helper thread (``apollo_help``) and returns once it has joined; the threads go to
    ``started``."""
    def eager(pool, tables):
        sync = tables.sync
        for k in range(D.SYNC_WORDS - 1):
            sync[k] = 0
        sync[D.SYNC_WORDS - 1] = D.sched_yield_address()
        t = threading.Thread(target=D.help_function(), args=(tables.sync_address, 0, 0))
        t.start()
        while sync[6] != 1:         # joined
            pass
        started.append(t)
        return tables.sync_address
    return eager


def _rebuild(exe):
    """Drop ``exe``'s driver program and tables (HELPER is read when they are built)."""
    exe._program = None
    for a in exe._arenas._free:
        a.driver = None


@pytest.mark.parametrize("case", sorted(CASES))
def test_parallel_steps_match_without_helper_and_onnxruntime(case, monkeypatch):
    m, x, f = _model(case)
    exe = f.specialization({"x": x.shape})
    monkeypatch.setattr(drive, "HELPER", False)
    _rebuild(exe)
    alone = f(x=x)
    assert not any(s.parallel for s in exe._program.segments)
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    for _ in range(10):
        got = f(x=x)
        np.testing.assert_array_equal(got, alone)
    assert any(s.parallel for s in exe._program.segments)
    np.testing.assert_allclose(got, ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-5)
    sync = exe._arenas._free[0].driver.sync
    # the helper either joined and left (6 = 1, 8 = 1) or found the call over (6 = 2)
    assert (sync[6], sync[8]) in ((1, 1), (2, 0)), list(sync)


def test_helper_that_joins_first_and_one_that_comes_late(monkeypatch):
    """The helper is started (and has joined) before the driver runs the first step: it
    spins until steps are published and takes part in every one; a helper run after the call
    returns at once (the call closed word 6)."""
    m, x, f = _model("odd_31x29_s2_k5_batch2")
    exe = f.specialization({"x": x.shape})
    want = f(x=x).copy()
    started = []
    monkeypatch.setattr(drive, "_start_helper", eager_helper(started))
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    for _ in range(5):
        np.testing.assert_array_equal(f(x=x), want)
    for t in started:
        t.join(10)
        assert not t.is_alive()
    sync = exe._arenas._free[0].driver.sync
    assert sync[6] == 1 and sync[8] == 1 and sync[7] == 1
    # late: the call is over (word 6 was 1; a closed call has 2), a helper returns at once
    sync[6] = 2
    late = threading.Thread(target=D.help_function(), args=(exe._arenas._free[0].driver.sync_address, 0, 0))
    late.start()
    late.join(10)
    assert not late.is_alive() and sync[6] == 2


def test_concurrent_calls_share_one_worker(monkeypatch):
    """Two Python threads call the model at once: each call has its own arena and shared state;
    the pool's one worker helps whichever call it reaches first."""
    m, x, f = _model("28x28_relu")
    want = f(x=x).copy()
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(f.specialization({"x": x.shape}))
    errors = []

    def loop():
        try:
            for _ in range(30):
                np.testing.assert_array_equal(f(x=x), want)
        except BaseException as exc:      # noqa: BLE001 - reported below
            errors.append(exc)
    ts = [threading.Thread(target=loop) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in ts)


def test_auto_asks_for_a_helper_only_while_the_cores_are_free(monkeypatch):
    """HELPER "auto": the program has parallel steps; a call asks for a helper only when the
    quiet gate says so, and runs each parallel step as one call otherwise (same numbers)."""
    m, x, f = _model("28x28")
    exe = f.specialization({"x": x.shape})
    want = f(x=x).copy()
    monkeypatch.setattr(drive, "HELPER", "auto")
    _rebuild(exe)
    asked = []
    monkeypatch.setattr(drive, "_start_helper", lambda pool, tables: asked.append(1) or None)
    monkeypatch.setattr(drive, "_QUIET", lambda: False)
    np.testing.assert_array_equal(f(x=x), want)
    assert any(s.parallel for s in exe._program.segments) and not asked
    monkeypatch.setattr(drive, "_QUIET", lambda: True)
    np.testing.assert_array_equal(f(x=x), want)
    assert asked


def test_quiet_gate_sees_another_process_spin():
    """A process that is not this one (a grandchild spinning 1.5 s) makes the gate say "busy"
    at its next judgement (on a 2-core machine: one core of two taken)."""
    import subprocess
    import sys
    import time
    from apollo_py.cpuload import QuietGate, cpu_busy
    if cpu_busy() is None:
        pytest.skip("no /proc/stat")
    import os
    cores = os.cpu_count() or 1
    gate = QuietGate(period=0.3, slack=0.4 - (cores - 2))    # others may take 0.4 of a core
    subprocess.run(["sh", "-c", f"{sys.executable} -c 'import time; t = time.time()\n"
                                "while time.time() - t < 1.5: pass' >/dev/null 2>&1 &"], check=True)
    time.sleep(0.8)
    assert gate() is False
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01:     # no judgement before `period` has passed
        assert gate() is False
