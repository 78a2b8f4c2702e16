"""Piecewise JIT cache in front of LLVM codegen: same piece compiled once, disk hits reload."""
from collections import OrderedDict

import numpy as np

import apollo_py as ap
from apollo_py.codegen import cached


def _graph(n=96):
    b = ap.GraphBuilder("cached")
    x = b.input("x", (8, n))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)])


def _want(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _new_process(monkeypatch):
    """Forget every kernel and cache object this process holds, as a fresh process would."""
    monkeypatch.setattr(cached, "_LOADED", OrderedDict())
    monkeypatch.setattr(cached, "_CACHES", {})
    monkeypatch.setattr(cached, "_OBJECTS", OrderedDict())


def _kernels(f):
    return [s.compiled for s in f.steps if hasattr(s, "compiled")]


def test_same_piece_is_compiled_once_per_process(tmp_path):
    opts = ap.Options(target="cpu", cache_dir=str(tmp_path))
    f1, f2 = ap.jit(_graph(), options=opts), ap.jit(_graph(), options=opts)
    k1, k2 = (_kernels(f.specialization({"x": (8, 96)})) for f in (f1, f2))
    assert k1 and [id(k) for k in k1] == [id(k) for k in k2]


def test_disk_hit_reloads_object_code(tmp_path, monkeypatch):
    x = np.random.default_rng(0).standard_normal((8, 80)).astype(np.float32)
    opts = ap.Options(target="cpu", cache_dir=str(tmp_path))
    _new_process(monkeypatch)
    first = ap.jit(_graph(80), options=opts)
    np.testing.assert_allclose(first(x), _want(x), rtol=1e-6, atol=1e-7)
    assert cached.piece_cache(str(tmp_path)).info()["entries"] >= 1

    _new_process(monkeypatch)   # nothing loaded, a fresh cache object over the same directory
    again = ap.jit(_graph(80), options=opts)
    np.testing.assert_allclose(again(x), _want(x), rtol=1e-6, atol=1e-7)
    info = cached.piece_cache(str(tmp_path)).info()
    assert info["disk_hits"] >= 1 and info["misses"] == 0
    assert all(k.ir == "" for k in _kernels(again.specialization({"x": (8, 80)})))


def test_corrupt_entry_is_recompiled(tmp_path, monkeypatch):
    x = np.random.default_rng(1).standard_normal((8, 72)).astype(np.float32)
    opts = ap.Options(target="cpu", cache_dir=str(tmp_path))
    _new_process(monkeypatch)
    ap.jit(_graph(72), options=opts)(x)
    for p in (tmp_path / "pieces").rglob("*.piece"):
        head = p.read_bytes().split(b"\n", 1)[0]
        p.write_bytes(head + b"\nnot an object file")     # the payload no longer matches its checksum
    _new_process(monkeypatch)
    f = ap.jit(_graph(72), options=opts)
    np.testing.assert_allclose(f(x), _want(x), rtol=1e-6, atol=1e-7)
    assert cached.piece_cache(str(tmp_path)).info()["misses"] >= 1


def test_a_second_cache_dir_gets_every_piece_this_process_has(tmp_path, monkeypatch):
    """Pieces this process compiled for one cache directory are written to another one it
    compiles the same model into, so a new process reading the second compiles nothing."""
    x = np.random.default_rng(2).standard_normal((8, 88)).astype(np.float32)
    _new_process(monkeypatch)
    first, second = tmp_path / "a", tmp_path / "b"
    ap.jit(_graph(88), options=ap.Options(target="cpu", cache_dir=str(first)))(x)
    f = ap.jit(_graph(88), options=ap.Options(target="cpu", cache_dir=str(second)))
    np.testing.assert_allclose(f(x), _want(x), rtol=1e-6, atol=1e-7)
    names = {p.name for p in (first / "pieces").rglob("*.piece")}
    assert names and names <= {p.name for p in (second / "pieces").rglob("*.piece")}
