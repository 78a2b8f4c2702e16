"""A model file that passed the ONNX checker is not checked again while it is unchanged."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import apollo_py as ap


def _save(path, op="Relu"):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "m", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_checker_runs_once_per_file_version(tmp_path, monkeypatch):
    path = str(tmp_path / "m.onnx")
    _save(path)
    calls = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (calls.append(m), real(m, *a, **k)))
    opts = ap.Options(cache_dir=str(tmp_path / "cache"))
    xv = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(ap.jit(path, options=opts)(xv), np.maximum(xv, 0))
    assert len(calls) == 1
    _save(path, "Abs")                                  # the file changes: checked again
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    np.testing.assert_array_equal(ap.jit(path, options=opts)(xv), np.abs(xv))
    assert len(calls) == 2


def test_a_model_the_checker_refuses_is_refused_every_time(tmp_path):
    path = str(tmp_path / "bad.onnx")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["y"])],
                          "bad", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    opts = ap.Options(cache_dir=str(tmp_path / "cache"))
    for _ in range(2):
        with pytest.raises(ap.ModelLoadError):
            ap.jit(path, options=opts)
