"""Gathers as generated kernels (codegen/gather.py) and a lone concat as a copy kernel: both run
inside native driver segments.  Numbers against onnxruntime (rtol 1e-6: a gather and a concat
copy); an index out of range still raises the reference's ShapeError naming the node and the
index tensor, through the kernel's error word, with the driver on and off."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import apollo_py as ap

ort = pytest.importorskip("onnxruntime")


def _embedding_model(rows=1000, dim=16, batch=5, tables=3, idx_dtype=T.INT64):
    """DLRM's sparse half: per table a column of ``sparse`` (Gather axis 1, constant index),
    a lookup (Gather axis 0) and a reshape, concatenated with ``dense`` (a concat with no kernel
    producer) and scaled."""
    rng = np.random.default_rng(0)
    inits, nodes, cat = [], [], ["dense"]
    for t in range(tables):
        inits.append(numpy_helper.from_array(rng.standard_normal((rows + t, dim)).astype(np.float32), f"E{t}"))
        inits.append(numpy_helper.from_array(np.array(t, np.int64), f"c{t}"))
        nodes += [helper.make_node("Gather", ["sparse", f"c{t}"], [f"col{t}"], axis=1),
                  helper.make_node("Gather", [f"E{t}", f"col{t}"], [f"emb{t}"], axis=0)]
        cat.append(f"emb{t}")
    inits.append(numpy_helper.from_array(np.array([2.0], np.float32), "two"))
    nodes += [helper.make_node("Concat", cat, ["cat"], axis=1), helper.make_node("Mul", ["cat", "two"], ["y"])]
    g = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("dense", T.FLOAT, [batch, dim]),
                                         helper.make_tensor_value_info("sparse", idx_dtype, [batch, tables])],
                          [helper.make_tensor_value_info("y", T.FLOAT, None),
                           helper.make_tensor_value_info("cat", T.FLOAT, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _feeds(batch, tables, rows, dim, np_idx=np.int64, seed=1):
    rng = np.random.default_rng(seed)
    # negative indices wrap (numpy's and ONNX's rule); -rows is the first row
    return {"dense": rng.standard_normal((batch, dim)).astype(np.float32),
            "sparse": rng.integers(-rows, rows, (batch, tables)).astype(np_idx)}


@pytest.mark.parametrize("batch,idx", [(5, T.INT64), (64, T.INT64), (7, T.INT32)])
def test_embedding_lookups_match_onnxruntime_in_one_segment(batch, idx):
    rows, dim, tables = 1000, 16, 3
    model = _embedding_model(rows, dim, batch, tables, idx)
    feeds = _feeds(batch, tables, rows, dim, np.int64 if idx == T.INT64 else np.int32)
    f = ap.jit(model, options=ap.Options(num_threads=2))
    got = f.run(**feeds)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)
    kinds = [k.to_dict()["kind"] for k in f.plan.kernels]
    assert kinds.count("reference") == 0, str(f.plan)      # gathers and the concat are kernels
    exe = f.specialization({k: v.shape for k, v in feeds.items()})
    assert [e[0] for e in exe._program.entries] == ["drive"], str(f.plan)
    exe.use_driver = False
    for g, w in zip(f.run(**feeds), want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("driver", [True, False])
def test_index_out_of_range_names_the_node_and_index_tensor(driver):
    rows, dim, tables, batch = 50, 8, 2, 4
    model = _embedding_model(rows, dim, batch, tables)
    f = ap.jit(model, options=ap.Options(num_threads=2))
    feeds = _feeds(batch, tables, rows, dim)
    good = f.run(**feeds)
    exe = f.specialization({k: v.shape for k, v in feeds.items()})
    exe.use_driver = driver
    for bad in (rows, -rows - 1, 2 ** 40):
        sparse = feeds["sparse"].copy()
        sparse[2, 0] = bad          # column 0 selects table E0, of 50 rows
        with pytest.raises(ap.ShapeError, match=r"node 'gather_\d+' \(gather, from ONNX node '[^']*'\): gather "
                                                r"index out of range \[-50, 50\) in index tensor '[^']*' "
                                                r"\(from graph input 'sparse'\)"):
            f.run(dense=feeds["dense"], sparse=sparse)
    # the error word was cleared: the next good call works and gives the same numbers
    for g, w in zip(f.run(**feeds), good):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("shape,axis,idx", [((6, 5, 4), 1, [[4, 0], [-1, 2]]), ((6, 5, 4), 2, 3),
                                            ((9,), 0, [8, -9, 0, 3]), ((3, 70, 33), 2, [32, 0, -33, 5, 5])])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_gather_kernel_matches_numpy_take(shape, axis, idx, dtype):
    b = ap.GraphBuilder("take")
    x = b.input("x", shape, dtype)
    y = b.gather(x, b.constant(np.array(idx, np.int64)), axis=axis)
    f = ap.jit(b.build([y]))
    xv = (np.random.default_rng(3).standard_normal(shape) * 100).astype(dtype)
    got = f(xv)
    assert [k.to_dict()["kind"] for k in f.plan.kernels] == ["kernel"], str(f.plan)
    np.testing.assert_array_equal(got, np.take(xv, np.array(idx), axis=axis))
