"""The runtime thread pool gives the same results as a single-threaded call."""
import threading

import numpy as np
import pytest

from apollo_py.codegen.llvm import compile_llvm
from apollo_py.runtime.threadpool import ThreadPool

import codegen_kernels as K


@pytest.fixture(scope="module")
def softmax():
    return compile_llvm(K.softmax_rows(301, 128))


def test_split_covers_extent():
    assert ThreadPool.split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert ThreadPool.split(2, 8) == [(0, 1), (1, 2)]
    assert ThreadPool.split(0, 4) == [(0, 0)]


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_identical_to_single_thread(softmax, threads, rng):
    x = (rng.standard_normal(301 * 128) * 4).astype(np.float32)
    ref = np.empty_like(x)
    softmax([x, ref])
    with ThreadPool(threads, chunks_per_thread=1 + threads % 3) as pool:
        for _ in range(3):
            out = np.empty_like(x)
            pool.run(softmax, [x, out])
            np.testing.assert_array_equal(out, ref)


def test_small_extent_and_min_chunk(rng):
    ck = compile_llvm(K.bias_gelu(3, 16))
    x = rng.standard_normal(48).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    ref = np.empty_like(x)
    ck([x, b, ref])
    with ThreadPool(4) as pool:
        for min_chunk in (1, 2, 100):
            out = np.empty_like(x)
            pool.run(ck, [x, b, out], min_chunk=min_chunk)
            np.testing.assert_array_equal(out, ref)


def test_concurrent_callers(softmax, rng):
    xs = [(rng.standard_normal(301 * 128) * 3).astype(np.float32) for _ in range(6)]
    refs = []
    for x in xs:
        r = np.empty_like(x)
        softmax([x, r])
        refs.append(r)
    outs = [np.empty_like(x) for x in xs]
    errors = []
    with ThreadPool(3) as pool:
        def caller(k):
            try:
                for _ in range(20):
                    pool.run(softmax, [xs[k], outs[k]])
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for out, ref in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(out, ref)


def test_run_after_close_runs_on_the_caller(softmax, rng):
    """A closed pool (close(), or the interpreter-exit hook under a daemon caller) has no
    workers; a run still computes the whole extent, on the calling thread (issue #16 item 7)."""
    x = (rng.standard_normal(301 * 128) * 4).astype(np.float32)
    ref = np.empty_like(x)
    softmax([x, ref])
    pool = ThreadPool(3)
    pool.close()
    pool.close()
    assert not any(t.is_alive() for t in pool._workers)
    out = np.empty_like(x)
    pool.run(softmax, [x, out])
    np.testing.assert_array_equal(out, ref)
    out2 = np.empty_like(x)
    pool.run_many([(softmax, [x, out2])])
    np.testing.assert_array_equal(out2, ref)


def test_split_all_reduce_is_parallel_and_reproducible(rng):
    from apollo_py.codegen import loopir as L
    from apollo_py.codegen.templates import split_all_reduce
    n = 100_003
    x, out = L.Param("x", "float32", n), L.Param("out", "float32", 1)
    k1, k2, partials = split_all_reduce("total", "sum", (x,), out, n, lambda r: x[r], parts=8)
    c1, c2 = compile_llvm(k1), compile_llvm(k2)
    data = rng.standard_normal(n).astype(np.float32)
    results = []
    for threads in (1, 2, 3):
        part = np.empty(8, np.float32)
        res = np.empty(1, np.float32)
        with ThreadPool(threads) as pool:
            pool.run(c1, [data, part])
        c2([part, res])
        results.append(res[0])
    assert results[0] == results[1] == results[2]
    np.testing.assert_allclose(results[0], data.astype(np.float64).sum(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("spin", [False, True])
def test_spinning_workers_take_jobs_and_stop(softmax, rng, monkeypatch, spin):
    """Workers that spin for their next job (``SPIN_US``, gated by ``QUIET``) run every job a
    caller posts right after the last one, and a pool closed while they spin stops."""
    import time
    from apollo_py.runtime import threadpool as TP
    monkeypatch.setattr(TP, "QUIET", lambda: spin)
    monkeypatch.setattr(TP, "SPIN_US", 200_000.0)     # long enough that they are spinning below
    x = (rng.standard_normal(301 * 128) * 4).astype(np.float32)
    ref = np.empty_like(x)
    softmax([x, ref])
    pool = ThreadPool(3, chunks_per_thread=2)
    seen = set()
    for _ in range(20):
        out = np.empty_like(x)
        pool.run(softmax, [x, out])
        np.testing.assert_array_equal(out, ref)
    lent = threading.Event()
    pool.lend(lambda *a: (seen.add(threading.current_thread().name), lent.set()), None, 0, 1)
    assert lent.wait(10) and seen and all(n.startswith("apollo-pool-") for n in seen)
    t = time.perf_counter()
    pool.close(timeout=10)
    assert not any(w.is_alive() for w in pool._workers)
    assert time.perf_counter() - t < 5
