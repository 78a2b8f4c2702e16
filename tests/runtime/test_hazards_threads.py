"""Issue #16 item 5: thread hazards read in the code, each with a test that failed before its fix."""
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import apollo_py as ap
from apollo_py import api
from apollo_py.runtime.threadpool import _Job


def _relu_model():
    """y = relu(x) with x of shape [N, 4]: one CompiledGraph, a specialisation per N."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_op_table_is_never_seen_half_filled():
    # the first ``import apollo_py.ops`` is slowed down while registering primitives; a second
    # thread polls the IR's op table: it must either be absent (GraphError) or complete
    code = textwrap.dedent("""
        import importlib.abc, sys, threading, time
        class Slow(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "apollo_py.ops.primitives":
                    time.sleep(0.5)
                return None
        sys.meta_path.insert(0, Slow())
        # the package without its __init__ (which imports ops whole): the IR alone, as a
        # thread sees it while another is inside the first import of the op registry
        import importlib.util, os, types
        spec = importlib.util.find_spec("apollo_py")
        pkg = types.ModuleType("apollo_py")
        pkg.__path__ = [os.path.dirname(spec.origin)]
        sys.modules["apollo_py"] = pkg
        from apollo_py.ir import optable
        from apollo_py.errors import GraphError
        seen, stop = [], threading.Event()
        def poll():
            while not stop.is_set():
                try:
                    seen.append(optable.op_table().has("add"))
                except GraphError:
                    pass
        t = threading.Thread(target=poll); t.start()
        import apollo_py.ops
        stop.set(); t.join()
        print("PARTIAL" if False in seen else "OK", len(seen))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK"), r.stdout


def test_trace_is_per_executable_and_per_thread():
    m = ap.jit(_relu_model(), target="cpu")
    x = np.arange(-8, 8, dtype=np.float32).reshape(4, 4)
    m(x)
    exe = m.specialization({"x": (4, 4)})
    other = m.specialization({"x": (2, 4)})
    exe.trace = mine = []
    t = threading.Thread(target=lambda: m(x))
    t.start()
    t.join()
    assert mine == []                       # another thread's call is not recorded here
    assert other.trace is None              # nor does another executable share the list
    np.testing.assert_array_equal(m(x), np.maximum(x, 0))
    assert len(mine) == len(exe._schedule) and all(dt >= 0 for _, dt in mine)
    exe.trace = None


def test_slow_compile_of_one_shape_does_not_block_another(monkeypatch):
    from apollo_py.frontend import staged
    real, entered, release = staged.compile_program, threading.Event(), threading.Event()

    def slow(program, shapes, options):
        if shapes["x"][0] == 3:
            entered.set()
            assert release.wait(30)
        return real(program, shapes, options)

    monkeypatch.setattr(staged, "compile_program", slow)
    m = ap.jit(_relu_model(), target="reference")
    t = threading.Thread(target=lambda: m.specialization({"x": (3, 4)}))
    t.start()
    try:
        assert entered.wait(30)
        done = []
        u = threading.Thread(target=lambda: done.append(m(np.ones((5, 4), np.float32))))
        u.start()
        u.join(30)
        assert done and done[0].shape == (5, 4)      # shape 5 compiled while shape 3 was stuck
        assert m.plan is not None                   # plan reads the cache under the lock
    finally:
        release.set()
        t.join()
    np.testing.assert_array_equal(m(-np.ones((3, 4), np.float32)), np.zeros((3, 4), np.float32))


def test_same_new_shape_from_threads_compiles_once(monkeypatch):
    from apollo_py.frontend import staged
    real, calls = staged.compile_program, []

    def counting(program, shapes, options):
        calls.append(shapes["x"])
        return real(program, shapes, options)

    monkeypatch.setattr(staged, "compile_program", counting)
    m = ap.jit(_relu_model(), target="reference")
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4)
    outs = [None] * 8

    def work(i):
        outs[i] = m(x)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert calls == [(6, 4)]
    for o in outs:
        np.testing.assert_array_equal(o, np.maximum(x, 0))


def test_specialisations_are_bounded(monkeypatch):
    monkeypatch.setattr(api, "MAX_SPECIALIZATIONS", 2)
    m = ap.jit(_relu_model(), target="reference")
    for n in (1, 2, 3, 4):
        x = np.full((n, 4), -1.0, np.float32)
        np.testing.assert_array_equal(m(x), np.zeros((n, 4), np.float32))
    assert len(m._cache) == 2 and set(m._cache) == {((3, 4),), ((4, 4),)}
    assert m.plan is m.specialization({"x": (4, 4)}).plan


def test_thread_pool_job_keeps_the_first_error():
    errors = [ValueError("first"), KeyError("second"), RuntimeError("third")]

    def failing(k):
        def f(ptrs, lo, hi):
            raise errors[k]
        return f

    job = _Job([(failing(k), None, 0, 1) for k in range(3)])
    job.work()
    assert job.done.is_set() and job.error is errors[0]


def test_thread_pool_reraises_the_first_error_to_the_caller():
    from apollo_py.runtime.threadpool import ThreadPool
    first = ValueError("chunk 0")

    def f(ptrs, lo, hi):
        raise first if lo == 0 else KeyError(f"chunk at {lo}")

    with ThreadPool(1) as pool:
        with pytest.raises(ValueError, match="chunk 0"):
            pool._dispatch([(f, None, lo, lo + 1) for lo in range(4)])
