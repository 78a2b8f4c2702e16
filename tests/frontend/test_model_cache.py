"""The model-level compile cache (apollo_py/frontend/model_cache.py).

A new process compiling an unchanged model file at the same shapes and options runs no pass:
no ONNX parse, no preprocess/partition, no layer 1-3, no isl, no LLVM (pinned by stage functions
that raise in that process).  Any change of the file, the options, the rule overlay or
apollo_py's sources is a miss, and the result then follows the change.
"""
from __future__ import annotations

import json
import os
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
from apollo_py.frontend import model_cache as mc

ZOO = Path(__file__).resolve().parents[1] / "models" / "zoo"
RTOL = 1e-4


def small_model(path: Path, scale: float = 1.0, extra_relu: bool = False) -> Path:
    """x[4,64] @ W[64,64] + b -> softmax (-> relu): W (16 KiB) is stored in the file's raw_data."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 64)) * scale).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y" if not extra_relu else "s"], axis=-1)]
    if extra_relu:
        nodes.append(helper.make_node("Relu", ["s"], ["y"]))
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def ort_run(path, feeds):
    ort = pytest.importorskip("onnxruntime")
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def test_scan_finds_every_raw_initializer(tmp_path):
    path = small_model(tmp_path / "m.onnx")
    data = path.read_bytes()
    digest, raw = mc.scan_onnx(data)
    model = onnx.load(str(path))
    for t in model.graph.initializer:
        off, n = raw[t.name]
        assert data[off:off + n] == t.raw_data
    # the digest covers the graph, not the weights
    assert mc.scan_onnx(data)[0] == digest
    off, n = raw["W"]
    changed = data[:off] + bytes(n) + data[off + n:]
    assert mc.scan_onnx(changed)[0] == digest
    assert mc.scan_onnx(data.replace(b"Softmax", b"Softmin"))[0] != digest
    with pytest.raises(ValueError):
        mc.scan_onnx(data[:len(data) // 2])


def test_second_compile_loads_the_stored_executable(tmp_path, stats):
    path = small_model(tmp_path / "m.onnx")
    opts = ap.Options(cache_dir=str(tmp_path / "cache"), num_threads=1)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    want = ort_run(path, {"x": x})[0]
    y1 = ap.jit(str(path), options=opts)(x=x)
    assert stats()["saves"] == 1 and stats()["hits"] == 0
    f = ap.jit(str(path), options=opts)
    y2 = f(x=x)
    assert stats()["hits"] == 1 and stats()["parses"] == 1, stats()      # one parse: the first jit
    assert rel_err(y1, want) <= RTOL and rel_err(y2, want) <= RTOL
    assert f.plan.timings[0][0] == "model cache"
    # a new shape is a new entry
    x8 = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    assert rel_err(f(x=x8), ort_run(path, {"x": x8})[0]) <= RTOL
    assert stats()["saves"] == 2


def test_change_of_file_options_overlay_or_sources_is_a_miss(tmp_path, stats, monkeypatch):
    path = small_model(tmp_path / "m.onnx")
    cache = str(tmp_path / "cache")
    opts = ap.Options(cache_dir=cache, num_threads=1)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)

    def compile_and_check(options):
        got = ap.jit(str(path), options=options)(x=x)
        assert rel_err(got, ort_run(path, {"x": x})[0]) <= RTOL
        return stats()

    assert compile_and_check(opts)["saves"] == 1
    assert compile_and_check(opts)["hits"] == 1
    # the same file rewritten with other weights (same size) and with another graph
    small_model(path, scale=3.0)
    s = compile_and_check(opts)
    assert s["hits"] == 1 and s["saves"] == 2
    small_model(path, scale=3.0, extra_relu=True)
    s = compile_and_check(opts)
    assert s["hits"] == 1 and s["saves"] == 3
    assert compile_and_check(opts)["hits"] == 2
    # options that change the result: a miss; options that do not: a hit
    assert compile_and_check(opts.replace(schedule_budget=100_000))["saves"] == 4
    assert compile_and_check(opts.replace(progress=False))["hits"] == 3
    # the rule overlay's content
    overlay = tmp_path / "overlay.toml"
    overlay.write_text("version = 1\n")
    assert compile_and_check(opts.replace(rules_overlay=str(overlay)))["saves"] == 5
    assert compile_and_check(opts.replace(rules_overlay=str(overlay)))["hits"] == 4
    overlay.write_text("version = 1\n# edited\n")
    assert compile_and_check(opts.replace(rules_overlay=str(overlay)))["saves"] == 6
    # apollo_py's sources
    monkeypatch.setattr(mc, "source_digest", lambda: "edited")
    s = compile_and_check(opts)
    assert s["saves"] == 7 and s["hits"] == 4


def test_corrupt_entry_is_a_miss_and_is_replaced(tmp_path, stats):
    path = small_model(tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    opts = ap.Options(cache_dir=str(cache), num_threads=1)
    x = np.ones((4, 64), np.float32)
    want = ap.jit(str(path), options=opts)(x=x)
    (pkl,) = (cache / "models").glob("*.pkl")
    data = bytearray(pkl.read_bytes())
    data[-10] ^= 0xFF
    pkl.write_bytes(bytes(data))
    got = ap.jit(str(path), options=opts)(x=x)
    np.testing.assert_array_equal(got, want)
    s = stats()
    assert s["hits"] == 0 and s["misses"] == 2 and s["saves"] == 2
    assert ap.jit(str(path), options=opts)(x=x) is not None and stats()["hits"] == 1


WARM = textwrap.dedent("""
    import json, sys
    import numpy as np
    path, cache, feeds_path, out_path = sys.argv[1:5]
    import apollo_py as ap
    from apollo_py import compiler, partition
    from apollo_py.codegen import llvm
    from apollo_py.frontend import onnx as fo, model_cache as mc
    from apollo_py.layers import lowering, layer1

    def forbidden(name):
        def f(*a, **k):
            raise AssertionError(f"the warm compile ran {name}")
        return f
    for mod, name in [(partition, "partition"), (partition, "preprocess"), (lowering, "lower_micro_graphs"),
                      (layer1, "fuse_micro_graph"), (llvm, "optimize_ir"), (llvm, "render_llvm"),
                      (fo, "read_model_proto"), (fo, "load_onnx")]:
        if hasattr(mod, name):
            setattr(mod, name, forbidden(name))
    import islpy
    islpy.Set = forbidden("islpy.Set")
    islpy.UnionSet = forbidden("islpy.UnionSet")
    # packed constant GEMM operands come from the entry's packed store (test_packed_store.py)
    from apollo_py.codegen import gemm
    gemm._aligned_zeros = forbidden("packing a constant GEMM operand")
    feeds = dict(np.load(feeds_path))
    f = ap.jit(path, options=ap.Options(cache_dir=cache, num_threads=2))
    outs = f.run(**feeds)
    np.savez(out_path, *outs)
    print(json.dumps({"stats": mc.STATS, "timings": [t[0] for t in f.plan.timings]}))
""")


@pytest.mark.parametrize("name", ["gpt2_small.dynamo.onnx", "resnet_small.torchscript.onnx"])
def test_new_process_warm_compile_runs_no_pass(tmp_path, name):
    path = ZOO / name
    if not path.exists():
        pytest.skip(f"{name} not in tests/models/zoo")
    rec = json.loads((ZOO / "manifest.json").read_text())[name]
    rng = np.random.default_rng(5)
    feeds = {i["name"]: (rng.integers(0, i["high"], i["shape"]) if "high" in i
                         else rng.standard_normal(i["shape"])).astype(i["dtype"]) for i in rec["inputs"]}
    np.savez(tmp_path / "feeds.npz", **feeds)
    cache = str(tmp_path / "cache")
    ap.jit(str(path), options=ap.Options(cache_dir=cache, num_threads=2)).run(**feeds)     # cold, this process
    script = tmp_path / "warm.py"
    script.write_text(WARM)
    proc = subprocess.run([sys.executable, str(script), str(path), cache, str(tmp_path / "feeds.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["stats"]["hits"] == 1 and doc["stats"]["parses"] == 0, doc["stats"]
    assert doc["timings"][0] == "model cache"
    got = np.load(tmp_path / "out.npz")
    want = ort_run(path, feeds)
    for i, w in enumerate(want):
        assert rel_err(got[f"arr_{i}"], w) <= RTOL


def test_mapped_weights_are_aligned_copies_where_the_file_misaligns_them(tmp_path):
    """protobuf puts raw_data at any offset; a misaligned view sends numpy down its slow
    buffered paths (DLRM's embedding gathers went from 0.6 to 15 ms a call on the warm path),
    so such views are aligned copies, with the same values."""
    misaligned = 0
    for k in range(1, 5):       # initializer names of four lengths shift the payload's offset
        w = np.arange(64, dtype=np.float32).reshape(16, 4) * (k + 1)
        g = helper.make_graph([helper.make_node("Relu", ["W" * k], ["y"])], "a", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "W" * k)])
        path = tmp_path / f"m{k}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
        mf = mc.model_file(path)
        off, nbytes = mf.raw["W" * k]
        assert nbytes == w.nbytes
        misaligned += off % 4 != 0
        a = mf.view(off, "<f4", w.shape, w.strides)
        assert a.flags.aligned and not a.flags.writeable
        np.testing.assert_array_equal(a, w)
    assert misaligned, "no name length gave a misaligned payload: the test checks nothing"
