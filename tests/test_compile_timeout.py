"""Options.compile_timeout (issue #16 item 2): a whole-compile deadline checked between units of
work in every long stage; past it, CompileTimeoutError naming the stage and the micro-graph or
kernel, and nothing half-written in the cache directory.

Stage by stage the deadline is made to pass at a known point with a fake clock (the stage's
first unit of work moves the clock past the end), so each test is deterministic on a loaded box;
one test uses the real clock on a zoo model."""
from __future__ import annotations

import json
import os
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import apollo_py as ap
from apollo_py import deadline
from apollo_py.errors import CompileTimeoutError, OptionsError

ZOO = Path(__file__).resolve().parent / "models" / "zoo"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def expire(self):
        self.now += 1e6


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(deadline, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def _two_kernel_graph(name):
    """Two independent reductions (two layer-1 kernels) and an elementwise tail."""
    b = ap.GraphBuilder(name)
    x = b.input("x", (16, 32))
    s = b.reduce_sum(b.exp(x), axes=(1,))
    t = b.reduce_max(b.tanh(x * 2.0), axes=(0,))
    return b.build([s, b.relu(t)])


def _want(x):
    return [np.exp(x).sum(axis=1), np.maximum(np.tanh(x * 2.0).max(axis=0), 0)]


def _assert_cache_clean(root):
    """No temp file, and every piece is a complete entry whose checksum matches (once this
    process's background packed-weight writer, a forked child, has finished)."""
    from apollo_py.frontend import packed_store
    packed_store.wait()
    for dirpath, _, files in os.walk(root):
        for f in files:
            assert not f.startswith(".tmp-"), os.path.join(dirpath, f)
            if f.endswith(".piece"):
                import hashlib
                head, _, payload = Path(dirpath, f).read_bytes().partition(b"\n")
                assert hashlib.sha256(payload).hexdigest() == json.loads(head)["sha256"]


@pytest.mark.parametrize("bad", [0, -1.0, "5", True])
def test_options_rejects_a_bad_compile_timeout(bad):
    with pytest.raises(OptionsError, match="compile_timeout"):
        ap.Options(compile_timeout=bad)


def test_a_generous_timeout_compiles_and_matches_numpy(tmp_path):
    x = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    f = ap.jit(_two_kernel_graph("ct_ok"), options=ap.Options(compile_timeout=600.0, cache_dir=str(tmp_path)))
    for got, want in zip(f(x), _want(x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (ZOO / "resnet_small.dynamo.onnx").exists(), reason="zoo small models not present")
def test_tiny_timeout_on_a_zoo_model_names_stage_and_node(tmp_path):
    """Real clock: 1 microsecond is over before the first ONNX node is lowered."""
    opts = ap.Options(compile_timeout=1e-6, cache_dir=str(tmp_path))
    f = ap.jit(str(ZOO / "resnet_small.dynamo.onnx"), options=opts)
    spec = json.loads((ZOO / "manifest.json").read_text())["resnet_small.dynamo.onnx"]
    feeds = {i["name"]: np.zeros(i["shape"], i["dtype"]) for i in spec["inputs"]}
    with pytest.raises(CompileTimeoutError, match=r"compile_timeout = 1e-06 s in stage 'ONNX lowering', "
                                                  r"at node '\w+' \(\w+\)") as e:
        f(**feeds)
    assert e.value.stage == "ONNX lowering" and e.value.where
    _assert_cache_clean(tmp_path)
    # the same model compiles afterwards without the deadline (nothing left half-done)
    g = ap.jit(str(ZOO / "resnet_small.dynamo.onnx"), options=opts.replace(compile_timeout=None))
    assert all(np.isfinite(o).all() for o in g(**feeds))
    _assert_cache_clean(tmp_path)


def test_timeout_in_partition_names_the_rule(tmp_path, clock, monkeypatch):
    import importlib
    agg = importlib.import_module("apollo_py.partition.aggregate")
    real = agg._State.apply

    def apply(self, rule):
        clock.expire()
        return real(self, rule)
    monkeypatch.setattr(agg._State, "apply", apply)
    f = ap.jit(_two_kernel_graph("ct_part"), options=ap.Options(compile_timeout=5.0, cache_dir=str(tmp_path)))
    with pytest.raises(CompileTimeoutError, match=r"in stage 'partition', at rule '\w+'"):
        f(np.ones((16, 32), np.float32))


def test_timeout_in_layer1_names_the_micro_graph(tmp_path, clock, monkeypatch):
    from apollo_py.layers import lowering
    real = lowering.absorb_concats

    class Groups(list):
        """The stitch groups; walking them forward (the lowering loop) expires the deadline
        once the first group was lowered (``reversed`` is list's own, so it does not)."""
        def __iter__(self):
            for g in list.__iter__(self):
                yield g
                clock.expire()

    monkeypatch.setattr(lowering, "absorb_concats", lambda *a, **kw: Groups(real(*a, **kw)))
    f = ap.jit(_two_kernel_graph("ct_l1"), options=ap.Options(compile_timeout=5.0, cache_dir=str(tmp_path)))
    with pytest.raises(CompileTimeoutError, match=r"in stage 'layer 1 fusion', at micro-graph \d+(-\d+)? .*first \w+ ") as e:
        f(np.ones((16, 32), np.float32))
    assert "micro-graph" in e.value.where
    _assert_cache_clean(tmp_path)


def test_timeout_in_llvm_codegen_names_the_kernel(tmp_path, clock, monkeypatch):
    from apollo_py.codegen import cached
    real = cached.compile_cached
    done = []

    def compile_one(*a, **kw):
        out = real(*a, **kw)
        done.append(out)
        clock.expire()          # the first piece is compiled (and stored): the deadline passes now
        return out
    monkeypatch.setattr(cached, "compile_cached", compile_one)
    f = ap.jit(_two_kernel_graph("ct_llvm"), options=ap.Options(compile_timeout=5.0, cache_dir=str(tmp_path)))
    with pytest.raises(CompileTimeoutError, match=r"in stage 'LLVM codegen', at kernel '\w+'"):
        f(np.ones((16, 32), np.float32))
    assert len(done) == 1       # stopped between pieces, after the first
    _assert_cache_clean(tmp_path)


def test_isl_scheduler_gets_at_most_the_time_left(clock, monkeypatch):
    """The scheduler's child process is capped by the deadline; stopped by it, the compile times
    out (instead of splitting the micro-graph as for Options.schedule_timeout)."""
    from apollo_py.poly import schedule
    from apollo_py.poly.bounded import WallTimeExceeded
    seen = []

    def run_bounded(fn, seconds):
        seen.append(seconds)
        clock.expire()
        raise WallTimeExceeded("stopped")
    monkeypatch.setattr(schedule, "run_bounded", run_bounded)
    prog = types.SimpleNamespace(statements=(1, 2), outputs=("y",))
    with deadline.compile_deadline(ap.Options(compile_timeout=0.5), "m"):
        with pytest.raises(CompileTimeoutError, match="isl scheduler"):
            schedule.bounded_isl_schedule(prog, None, 1000, 2.0)
    assert seen == [0.5]
    # without a deadline the scheduler's own limit applies and over it the caller splits
    with pytest.raises(schedule.BudgetExceeded):
        schedule.bounded_isl_schedule(prog, None, 1000, 2.0)
    assert seen == [0.5, 2.0]


def test_deadline_is_per_compile_and_per_thread(clock):
    seen = []
    with deadline.compile_deadline(ap.Options(compile_timeout=1.0), "outer") as d:
        with deadline.compile_deadline(ap.Options(compile_timeout=99.0), "inner") as inner:
            assert inner is d       # a nested compile keeps the outer deadline
        clock.expire()
        t = threading.Thread(target=lambda: seen.append(deadline.seconds_left()))
        t.start()
        t.join()
        with pytest.raises(CompileTimeoutError):
            deadline.check("stage")
    assert seen == [None]           # another thread's compile has no deadline of this one
    deadline.check("stage")         # and none outside the block


@pytest.mark.skipif(not (ZOO / "resnet_small.dynamo.onnx").exists(), reason="zoo small models not present")
def test_cli_compile_timeout(tmp_path, capsys):
    from apollo_py.cli import main
    model = str(ZOO / "resnet_small.dynamo.onnx")
    assert main(["--cache-dir", str(tmp_path), "--compile-timeout", "1e-6", "explain", model,
                 "--shape", "x=1,3,32,32"]) == 2
    assert "ran past Options.compile_timeout = 1e-06 s in stage 'ONNX lowering'" in capsys.readouterr().err
    assert main(["--compile-timeout", "0", "explain", model]) == 2
    assert "Options.compile_timeout must be None or a number of seconds > 0" in capsys.readouterr().err
