"""Soak, reduced (issue #16 item 7; ``make soak`` runs the full counts, tools/soak.py):
memory and file descriptors stay flat over many calls, the thread pool stops cleanly at
interpreter exit, and compiles killed at random moments leave nothing a reader would trust
half-written (and what they leave is swept)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.cache import STALE_S, sweep_stale

sys.path.insert(0, os.path.dirname(__file__))
from soak_lib import (SMALL_ZOO, as_list, cache_problems, killed_compiles, soak_calls,  # noqa: E402
                      stale_files, zoo_feeds)

SMALL = "dlrm_small.dynamo.onnx"
needs_small = pytest.mark.skipif(not (SMALL_ZOO / SMALL).exists(), reason="zoo small models not present")

#: tolerances of the reduced soak (3,000 calls): no new fd; RSS within 4 MiB after the warm-up
RSS_TOLERANCE = 4 << 20


@needs_small
@pytest.mark.parametrize("with_out", [False, True])
def test_calls_keep_rss_and_fds_flat(tmp_path, with_out):
    f = ap.jit(str(SMALL_ZOO / SMALL), options=ap.Options(cache_dir=str(tmp_path)))
    feeds = zoo_feeds(SMALL)
    out = [np.empty_like(o) for o in as_list(f(**feeds))] if with_out else None
    r = soak_calls(f, feeds, 3000, out=out)
    assert r["mismatches"] == 0
    assert r["fds_growth"] == 0, r["fds"]
    assert r["rss_growth"] <= RSS_TOLERANCE, [x >> 20 for x in r["rss"]]


_EXIT_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    # registered before apollo_py's hook, so it runs after it (atexit is last-in, first-out)
    atexit.register(lambda: print("pool workers alive after exit hooks:",
                                  sum(t.name.startswith("apollo-pool") and t.is_alive()
                                      for t in threading.enumerate()), flush=True))
    import numpy as np, apollo_py as ap
    b = ap.GraphBuilder("exit")
    x = b.input("x", (64, 4096))
    f = ap.jit(b.build([b.exp(b.tanh(x)) + 1.0]), options=ap.Options(num_threads=2, cache_dir=sys.argv[1]))
    a = np.ones((64, 4096), np.float32)
    want = np.exp(np.tanh(a)) + 1
    assert np.allclose(f(a), want)
    print("workers:", sum(t.name.startswith("apollo-pool") for t in threading.enumerate()), flush=True)
    def spin():                       # a daemon caller still running when the program ends
        while True:
            assert np.allclose(f(a), want)
    threading.Thread(target=spin, daemon=True).start()
""")


def test_thread_pool_stops_cleanly_at_interpreter_exit(tmp_path):
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "workers: 1" in r.stdout, r.stdout
    assert "pool workers alive after exit hooks: 0" in r.stdout, r.stdout
    assert r.stderr == "", r.stderr


def test_closed_pool_runs_jobs_on_the_caller():
    """After close() (or the exit hook) a call still computes, on the calling thread alone."""
    from apollo_py.runtime.threadpool import ThreadPool
    b = ap.GraphBuilder("closed_pool")
    x = b.input("x", (256, 1024))
    f = ap.jit(b.build([b.exp(x)]), options=ap.Options(num_threads=2))
    a = np.full((256, 1024), 0.5, np.float32)
    pools = [s for s in vars(f.specialization({"x": (256, 1024)})).values() if isinstance(s, ThreadPool)]
    assert pools, "the executable keeps its pool"
    pools[0].close()
    try:
        np.testing.assert_allclose(f(a), np.exp(a), rtol=1e-6)
        assert not any(t.is_alive() for t in pools[0]._workers)
    finally:
        from apollo_py.runtime import cpu
        with cpu._POOL_LOCK:        # later tests get a fresh pool with workers
            cpu._POOLS.pop(pools[0].num_threads, None)


@needs_small
def test_killed_compiles_leave_nothing_half_written(tmp_path):
    cache = str(tmp_path / "cache")
    r = killed_compiles(SMALL_ZOO / SMALL, cache, kills=3, seed=1, max_delay=1.0)
    assert r["killed"] + r["finished"] == 3 and r["started"] == 3
    assert r["problems"] == [], r["problems"]
    # what a kill between a temp file's creation and its rename leaves (too short a window to
    # hit reliably by chance), and an entry of the two-file format of earlier versions: made
    # by hand here
    pieces = os.path.join(cache, "pieces", "ab")
    os.makedirs(pieces, exist_ok=True)
    left = [os.path.join(pieces, ".tmp-killed"), os.path.join(pieces, "ab" + "0" * 62 + ".bin"),
            os.path.join(cache, ".tmp-machine")]
    for p in left:
        with open(p, "wb") as fh:
            fh.write(b"partial")
    assert set(left) <= set(stale_files(cache))
    assert cache_problems(cache) == []
    # a fresh compile there ignores them and computes the right numbers
    feeds = zoo_feeds(SMALL)
    got = ap.jit(str(SMALL_ZOO / SMALL), options=ap.Options(cache_dir=cache))(**feeds)
    want = ap.jit(str(SMALL_ZOO / SMALL), target="reference")(**feeds)
    for g, w in zip(as_list(got), as_list(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # young files may belong to a live writer: kept; once stale they are swept
    assert not set(left) & set(sweep_stale(cache))
    old = time.time() - STALE_S - 1
    for p in stale_files(cache):
        os.utime(p, (old, old))
    from apollo_py.cache import PieceCache
    PieceCache(cache).put("cd" + "1" * 62, b"payload", {"kind": "test"})   # a process's first write sweeps
    assert stale_files(cache) == []
    assert cache_problems(cache) == []
