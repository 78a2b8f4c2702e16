"""Issue #16 item 1: one CompiledGraph called from 8 threads at once -- same shapes, new shapes
compiling while others run, ``out=``, ``run_updating`` on per-thread parameters -- gives what
serial numpy gives; two processes compiling one model into one cache directory both succeed
and leave valid entries.  (``make soak``-sized counts: tools/soak.py; here a few calls each.)"""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
from onnx import TensorProto, helper, numpy_helper, save

import apollo_py as ap

D = 16
THREADS, ROUNDS = 8, 3
SHAPES = (3, 5, 7, 11)      # rows: primes and a shape each thread reaches in a different order


def _model():
    """y = tanh(x @ w) + x, w_new = 0.5 * w + tanh(w): x is [N, D], w is [D, D]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [D, D])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", D])
    wn = helper.make_tensor_value_info("w_new", TensorProto.FLOAT, [D, D])
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Tanh", ["xw"], ["t"]),
             helper.make_node("Add", ["t", "x"], ["y"]), helper.make_node("Mul", ["w", "half"], ["hw"]),
             helper.make_node("Tanh", ["w"], ["tw"]), helper.make_node("Add", ["hw", "tw"], ["w_new"])]
    g = helper.make_graph(nodes, "conc", [x, w], [y, wn], initializer=[half])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _want(x, w):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    return np.tanh(x64 @ w64) + x64, 0.5 * w64 + np.tanh(w64)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_eight_threads_same_and_new_shapes_out_and_run_updating():
    f = ap.jit(_model(), target="cpu")
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((D, D)) * 0.3).astype(np.float32)
    xs = {n: rng.standard_normal((n, D)).astype(np.float32) for n in SHAPES}
    errors, checked = [], [0] * THREADS
    start = threading.Barrier(THREADS)

    def work(t):
        try:
            w_mine = w0 + np.float32(0.01 * t)          # this thread's own parameter set
            start.wait()
            for r in range(ROUNDS):
                n = SHAPES[(t + r) % len(SHAPES)]
                x = xs[n]
                y, wn = f(x, w_mine)                         # plain call
                wy, wwn = _want(x, w_mine)
                _close(y, wy)
                _close(wn, wwn)
                oy, own = np.empty((n, D), np.float32), np.empty((D, D), np.float32)
                res = f.run(x, w_mine, out=[oy, own])        # out=
                assert res[0] is oy and res[1] is own
                _close(oy, wy)
                _close(own, wwn)
                before = w_mine.copy()
                outs = f.run_updating({"w_new": "w"}, x=x, w=w_mine)   # updates w_mine in place
                assert outs[1] is w_mine
                wy2, wwn2 = _want(x, before)
                _close(outs[0], wy2)
                _close(w_mine, wwn2)
                checked[t] += 3
        except BaseException as e:      # noqa: BLE001 - reported below
            errors.append((t, e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert checked == [3 * ROUNDS] * THREADS
    assert len(f._cache) == len(SHAPES)          # each shape compiled once, all kept


_CHILD = textwrap.dedent("""
    import sys, numpy as np, apollo_py as ap
    model, cache = sys.argv[1], sys.argv[2]
    f = ap.jit(model, options=ap.Options(target="cpu", cache_dir=cache, machine="conservative"))
    x = np.linspace(-1, 1, 5 * 16, dtype=np.float32).reshape(5, 16)
    w = np.linspace(-0.3, 0.3, 16 * 16, dtype=np.float32).reshape(16, 16)
    y, wn = f(x, w)
    np.save(sys.argv[3], y)
""")


def test_two_processes_compile_into_one_cache_dir(tmp_path):
    from apollo_py.cache import PieceCache
    path = str(tmp_path / "m.onnx")
    save(_model(), path)
    cache = str(tmp_path / "cache")
    env = dict(os.environ, APOLLO_PY_CACHE_DIR=cache)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, path, cache, str(tmp_path / f"y{k}.npy")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    x = np.linspace(-1, 1, 5 * 16, dtype=np.float32).reshape(5, 16)
    w = np.linspace(-0.3, 0.3, 16 * 16, dtype=np.float32).reshape(16, 16)
    for k in range(2):
        _close(np.load(tmp_path / f"y{k}.npy"), _want(x, w)[0])
    keys = [name[:-len(".piece")] for _, _, files in os.walk(os.path.join(cache, "pieces")) for name in files
            if name.endswith(".piece")]
    stray = [name for _, _, files in os.walk(cache) for name in files
             if name.startswith(".tmp-")]        # fsutil.atomic_write's temporaries
    assert keys and not stray, stray
    fresh = PieceCache(cache)
    assert all(fresh.get(k) is not None for k in keys)    # every entry reads back checksummed


def test_a_killed_compile_child_leaves_no_temporary(tmp_path, monkeypatch):
    """``share_with_child`` kills a child that overruns its deadline (a stuck LLVM lock); the
    piece it was writing then stays a ``.tmp-<pid>-*`` file, which the parent removes -- and
    only that child's, not another writer's."""
    import time
    from apollo_py import fsutil
    from apollo_py.codegen import cached
    cache = tmp_path / "cache"
    (cache / "pieces" / "ab").mkdir(parents=True)
    other = cache / "pieces" / "ab" / ".tmp-1-other"       # another process, still writing
    other.write_bytes(b"x")

    def fn(i):
        if os.getpid() != parent:                    # the child: a temp file, then stuck
            fsutil.atomic_write(str(cache / "pieces" / "ab" / "ok.bin"), b"done")
            (cache / "pieces" / "ab" / f".tmp-{os.getpid()}-half").write_bytes(b"half")
            time.sleep(60)
        return i

    parent = os.getpid()
    monkeypatch.setattr(cached, "PARALLEL_MIN", 2)
    monkeypatch.setattr(cached, "_cores", lambda: 2)
    real_reap = cached._reap
    monkeypatch.setattr(cached, "_reap", lambda pid, deadline: real_reap(pid, time.monotonic() + 1.0))
    got = cached.share_with_child([0, 1], fn, str(cache))
    assert got == {0: 0}
    left = sorted(p.name for p in (cache / "pieces" / "ab").iterdir())
    assert left == [".tmp-1-other", "ok.bin"], left
