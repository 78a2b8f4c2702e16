"""Packed constant GEMM operands stored with a model-cache entry (apollo_py/frontend/packed_store.py).

A warm compile in a new process maps the packed buffers and packs nothing; a buffer whose GEMM
blocking or source weights changed is not used (packed again, file rewritten), and the results
always match onnxruntime.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap
from frontend_testlib import rel_err
from apollo_py.codegen import gemm
from apollo_py.frontend import model_cache as mc
from apollo_py.frontend import packed_store

RTOL = 1e-4


def gemm_model(path: Path, scale: float = 1.0) -> Path:
    """conv(x[1,8,12,12], Wc[16,8,3,3]) (a constant A) * S[16,12,12] -> flatten -> @ W[2304,64]
    (a constant B) + b -> relu.  The weights sit in the file's raw_data; S (read by a kernel, not
    packed) is named so that protobuf misaligns it."""
    rng = np.random.default_rng(11)
    wc = (rng.standard_normal((16, 8, 3, 3)) * scale).astype(np.float32)
    sc = rng.uniform(0.5, 1.5, (16, 12, 12)).astype(np.float32)
    w = (rng.standard_normal((16 * 12 * 12, 64)) * 0.05 * scale).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    for k in range(1, 5):       # a name length that misaligns S's payload
        s_name = "S" * k
        nodes = [helper.make_node("Conv", ["x", "Wconv"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Mul", ["c", s_name], ["cs"]), helper.make_node("Flatten", ["cs"], ["f"], axis=1),
                 helper.make_node("MatMul", ["f", "Wlin"], ["m"]), helper.make_node("Add", ["m", "bias"], ["a"]),
                 helper.make_node("Relu", ["a"], ["y"])]
        g = helper.make_graph(nodes, "packed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(wc, "Wconv"), numpy_helper.from_array(sc, s_name),
                               numpy_helper.from_array(w, "Wlin"), numpy_helper.from_array(b, "bias")])
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        if mc.model_file(path).raw[s_name][0] % 4:
            return path
    raise AssertionError("no name length misaligned S: the test would check nothing")


def options(cache) -> ap.Options:
    return ap.Options(cache_dir=str(cache), num_threads=2, gemm="generated")


X = np.random.default_rng(2).standard_normal((1, 8, 12, 12)).astype(np.float32)


def ort_y(path):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def compile_and_check(path, cache):
    f = ap.jit(str(path), options=options(cache))
    assert rel_err(f(x=X), ort_y(path)) <= RTOL
    packed_store.wait()
    return f


WARM = textwrap.dedent("""
    import json, sys
    import numpy as np
    path, cache, x_path, out_path = sys.argv[1:5]
    import apollo_py as ap
    from apollo_py.codegen import gemm
    from apollo_py.frontend import model_cache as mc, packed_store

    def forbidden(*a, **k):
        raise AssertionError("the warm compile packed a constant GEMM operand")
    gemm._aligned_zeros = forbidden
    copies = []     # weights copied because protobuf misaligned them: none, the side file has them
    view = mc.ModelFile.view
    def counted(self, offset, dtype, shape, strides):
        copies.extend([offset] if offset % np.dtype(dtype).alignment else [])
        return view(self, offset, dtype, shape, strides)
    mc.ModelFile.view = counted
    f = ap.jit(path, options=ap.Options(cache_dir=cache, num_threads=2, gemm="generated"))
    np.save(out_path, f(x=np.load(x_path)))
    print(json.dumps({"stats": mc.STATS, "packed": packed_store.STATS, "modules": sorted(sys.modules),
                      "copies": copies}))
""")


def test_new_process_maps_the_packed_operands(tmp_path, stats):
    path = gemm_model(tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    compile_and_check(path, cache)                  # cold: packs both weights once, stores them
    s = stats()
    assert s["packed"] == 0 and s["written"] == 1, s
    (packed,) = (cache / "models").glob("*.packed")
    (tmp_path / "warm.py").write_text(WARM)
    np.save(tmp_path / "x.npy", X)
    proc = subprocess.run([sys.executable, str(tmp_path / "warm.py"), str(path), str(cache), str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["stats"]["hits"] == 1, doc["stats"]
    # the conv's weight (A) and the linear layer's (B): mapped, not packed, file not rewritten
    assert doc["packed"] == {"mapped": 2, "packed": 0, "written": 0}, doc["packed"]
    assert rel_err(np.load(tmp_path / "y.npy"), ort_y(path)) <= RTOL
    assert doc["copies"] == []
    # what a warm compile does not import (~0.3 s of it without .pyc files): the partitioner's
    # networkx, layer 1 and islpy, the ONNX reader
    assert not {"networkx", "islpy", "onnx", "apollo_py.layers.layer1"} & set(doc["modules"])
    assert packed.stat().st_size > (16 * 12 * 12 * 64 + 16 * 8 * 9) * 4


def test_changed_blocking_is_not_read_and_is_repacked(tmp_path, stats, monkeypatch):
    """The entry's key does not change with the blocking (it comes from the CPU, which keys the
    entry anyway; here it is forced): the records' tags do, so the buffers are packed again and
    the file rewritten for the new blocking."""
    path = gemm_model(tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    hits = mc.STATS["hits"]
    compile_and_check(path, cache)
    compile_and_check(path, cache)
    s = stats()
    assert s["mapped"] == 2 and s["packed"] == 0 and s["written"] == 1, s
    chosen = gemm.blocking_for
    swap = {12: 8, 8: 12, 6: 4, 4: 6}       # the other micro-tile height of the same vector width

    def other(*args, **kw):
        return replace(chosen(*args, **kw), mr=swap[chosen(*args, **kw).mr])
    monkeypatch.setattr(gemm, "blocking_for", other)
    # the 12x12 conv runs on the channel-vector kernel (codegen/conv_cvec.py): its panel width
    from apollo_py.codegen import conv_cvec
    cv_chosen = conv_cvec.cvec_blocking
    def cv_other(*args, **kw):     # 16 output channels: one vector a panel -> two
        b = cv_chosen(*args, **kw)
        return replace(b, nv=3 - b.nv)
    monkeypatch.setattr(conv_cvec, "cvec_blocking", cv_other)
    f = compile_and_check(path, cache)
    s = stats()
    assert s["mapped"] == 2 and s["packed"] == 2 and s["written"] == 2, s
    assert mc.STATS["hits"] - hits == 2       # the same entry: only the buffers' tags changed
    compile_and_check(path, cache)              # the rewritten file has the new blocking's tags
    s = stats()
    assert s["mapped"] == 4 and s["packed"] == 2 and s["written"] == 2, s
    del f


def test_changed_weights_are_not_read(tmp_path, stats):
    """Other weights are another model-cache entry (the file's identity); a packed file of other
    weights put under this entry's name (a stale or foreign file) fails the tags' value check."""
    a, b = gemm_model(tmp_path / "a.onnx"), gemm_model(tmp_path / "b.onnx", scale=3.0)
    cache = tmp_path / "cache"
    compile_and_check(a, cache)
    before = set((cache / "models").glob("*.packed"))
    compile_and_check(b, cache)
    (pb,) = set((cache / "models").glob("*.packed")) - before
    (pa,) = before
    s = stats()
    assert s["written"] == 2 and s["mapped"] == 0, s
    shutil.copyfile(pa, pb)
    compile_and_check(b, cache)                 # b's entry, a's buffers: packed again from b
    s = stats()
    assert s["mapped"] == 0 and s["packed"] == 2 and s["written"] == 3, s
    compile_and_check(b, cache)
    assert stats()["mapped"] == 2


def test_no_packed_file_outlives_a_failed_entry_write(tmp_path, monkeypatch, stats):
    path = gemm_model(tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    write = mc._write
    monkeypatch.setattr(mc, "_write", lambda p, data: False if p.endswith(".pkl") else write(p, data))
    compile_and_check(path, cache)
    assert stats()["saves"] == 0 and stats()["written"] == 0
    assert not list((cache / "models").glob("*.packed")) and not list((cache / "models").glob("*.pkl"))


def test_eviction_counts_every_file_of_an_entry_and_drops_orphans(tmp_path):
    import os
    import time
    d = tmp_path / "models"
    d.mkdir()
    now = time.time()

    def put(name, size, age):
        p = d / name
        p.write_bytes(b"\0" * size)
        os.utime(p, (now - age, now - age))
    for i, age in enumerate((30, 20, 10)):              # e2 most recently used
        put(f"e{i}.pkl", 100, age)
        put(f"e{i}.packed", 1000, age)
    put("old.packed", 10, mc.ORPHAN_AGE_S + 5)          # its .pkl is gone: an orphan
    put("young.arrays", 10, 1)                          # maybe another process's entry being written
    put(".tmp-dead", 10, mc.ORPHAN_AGE_S + 5)
    put(".tmp-live", 10, 1)
    put("abc.json", 10, mc.ORPHAN_AGE_S + 5)            # a header, not an entry file
    mc._evict(str(d), keep=32, max_bytes=2300)          # room for two entries' packed files, not three
    assert sorted(p.name for p in d.iterdir()) == [".tmp-live", "abc.json", "e1.packed", "e1.pkl",
                                                    "e2.packed", "e2.pkl", "young.arrays"]
    mc._evict(str(d), keep=1, max_bytes=1 << 30)
    assert sorted(p.name for p in d.iterdir()) == [".tmp-live", "abc.json", "e2.packed", "e2.pkl", "young.arrays"]
    mc._evict(str(d), keep=32, max_bytes=1)             # the newest entry stays whatever its size
    assert {"e2.packed", "e2.pkl"} <= {p.name for p in d.iterdir()}


EXIT = textwrap.dedent("""
    import sys, time
    import numpy as np
    path, cache = sys.argv[1:3]
    import apollo_py as ap
    from apollo_py.frontend import packed_store
    write = packed_store._write
    def slow(*a):               # a slow disk: the packed file takes 3 s to write
        time.sleep(3)
        return write(*a)
    packed_store._write = slow
    f = ap.jit(path, options=ap.Options(cache_dir=cache, num_threads=2, gemm="generated"))
    f(x=np.zeros((1, 8, 12, 12), np.float32))
    print(time.perf_counter(), flush=True)
""")


def test_a_process_does_not_wait_for_the_packed_write_at_exit(tmp_path):
    import os
    import time
    if not hasattr(os, "fork"):
        pytest.skip("the packed file is written by a forked child")
    path = gemm_model(tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    (tmp_path / "exit.py").write_text(EXIT)
    proc = subprocess.run([sys.executable, str(tmp_path / "exit.py"), str(path), str(cache)],
                          capture_output=True, text=True, timeout=120)
    ended = time.perf_counter()
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (perf_counter is CLOCK_MONOTONIC: comparable across processes on Linux)
    assert ended - float(proc.stdout.split()[-1]) < 2.5, "the process waited for the packed write"
    for _ in range(200):        # the child finishes the write after its parent is gone
        if list((cache / "models").glob("*.packed")):
            break
        time.sleep(0.1)
    (packed,) = (cache / "models").glob("*.packed")
    assert packed.read_bytes()[:16] == packed_store.MAGIC


def test_a_warm_load_waits_for_a_live_writer_only(tmp_path):
    """A warm process that finds the writer's temporary file (``.tmp-<pid>-<name>-*``) of a live
    process waits for the packed file instead of packing the weights itself; a dead writer's
    leftover (or none) does not hold it up."""
    import os
    import threading
    import time
    path = str(tmp_path / "k.packed")
    dead = tmp_path / f".tmp-{2 ** 22 + 12345}-k.packed-x"       # no such pid (above pid_max)
    dead.write_bytes(b"")
    t0 = time.perf_counter()
    assert not packed_store.wait_for_writer(path, 5.0)
    assert time.perf_counter() - t0 < 1.0
    (tmp_path / f".tmp-{os.getpid()}-k.packed-y").write_bytes(b"")     # a live writer
    threading.Timer(0.3, lambda: open(path, "wb").close()).start()
    t0 = time.perf_counter()
    assert packed_store.wait_for_writer(path, 5.0)
    assert 0.25 < time.perf_counter() - t0 < 4.0
    os.unlink(path)
    t0 = time.perf_counter()        # a live writer that never finishes: bounded by the timeout
    assert not packed_store.wait_for_writer(path, 0.2)
    assert time.perf_counter() - t0 < 1.5
