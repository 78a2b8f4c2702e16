"""OpenBLAS held at one thread while an executable with BLAS steps runs (runtime/blas.py,
OneBlasThread): entered and restored, nested and concurrent runs sharing one count, and the
model's results unchanged."""
import threading

import numpy as np
import pytest

from apollo_py.runtime.blas import OneBlasThread, one_blas_thread

one = one_blas_thread()
pytestmark = pytest.mark.skipif(not one.available, reason="numpy's BLAS has no openblas_set_num_threads")


@pytest.fixture
def two_threads():
    before = one._get()
    one._set(2)
    yield
    one._set(before)


def test_held_at_one_and_restored(two_threads):
    with one:
        assert one._get() == 1
        with one:                    # nested: still one, and the outer exit restores
            assert one._get() == 1
        assert one._get() == 1
    assert one._get() == 2


def test_concurrent_runs_share_the_count(two_threads):
    inside, release = threading.Barrier(3), threading.Event()
    seen = []

    def run():
        with one:
            inside.wait()
            release.wait()
            seen.append(one._get())
    ts = [threading.Thread(target=run) for _ in range(2)]
    for t in ts:
        t.start()
    inside.wait()
    assert one._get() == 1
    release.set()
    for t in ts:
        t.join()
    assert seen == [1, 1] and one._get() == 2


def test_executable_with_a_blas_step(two_threads):
    import apollo_py as ap
    from onnx import TensorProto, helper
    V = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)     # noqa: E731
    g = helper.make_graph([helper.make_node("MatMul", ["x", "y"], ["z"]), helper.make_node("Tanh", ["z"], ["t"])],
                          "g", [V("x", [96, 64]), V("y", [64, 80])], [V("t", [96, 80])])
    f = ap.jit(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), options=ap.Options(num_threads=2))
    assert "blas" in str(f.plan)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((96, 64)).astype(np.float32), rng.standard_normal((64, 80)).astype(np.float32)
    np.testing.assert_allclose(f(x, y), np.tanh(x.astype(np.float64) @ y), rtol=1e-4, atol=1e-5)
    assert one._get() == 2          # restored after the call


def test_a_library_without_the_symbols_is_left_alone(monkeypatch):
    monkeypatch.setattr("apollo_py.runtime.blas.loaded_libraries", lambda: iter(()))
    o = OneBlasThread()
    assert not o.available
    with o:
        pass
