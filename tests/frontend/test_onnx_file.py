"""A model file is read once: weight-free parse and check, weights mapped (frontend/onnx_file.py)."""
import mmap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import ModelLoadError
from apollo_py.frontend import onnx_file
from apollo_py.frontend.onnx import load_onnx


def _mlp(ir_version=10):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 8)).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    idx = np.array([2, 0, 1], np.int64)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b1"], ["a"], name="add"),
             helper.make_node("Gather", ["a", "idx"], ["y"], axis=1, name="gather")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                           numpy_helper.from_array(idx, "idx")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = ir_version
    return m, (w1, b1, idx)


def _plain(path, monkeypatch):
    """What loading ``path`` the plain way (one full parse, the checker on the file) gives."""
    with monkeypatch.context() as mp:
        mp.setattr(onnx_file, "read_stripped", lambda *a, **k: None)
        try:
            return load_onnx(path)
        except ModelLoadError as e:
            return e


def test_weights_are_views_of_the_file_and_the_checker_gets_no_weights(tmp_path, monkeypatch):
    from apollo_py.frontend.model_cache import scan_onnx
    m, (w1, b1, idx) = _mlp()
    for pad in range(8):        # w1 at a float-aligned file offset, idx (int64) not
        m.doc_string = "x" * pad
        offsets = {k: off for k, (off, _) in scan_onnx(m.SerializeToString())[1].items()}
        if offsets["w1"] % 4 == 0 and offsets["idx"] % 8:
            break
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda x, *a, **k: (seen.append(x), real(x, *a, **k))[1])
    prog = load_onnx(path)
    assert len(seen) == 1 and isinstance(seen[0], bytes)
    assert len(seen[0]) < len(open(path, "rb").read()) - w1.nbytes     # the payloads were left out
    for name, want in (("w1", w1), ("b1", b1), ("idx", idx)):
        got = prog.initializers[name]
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and not got.flags.writeable
        # an aligned payload is a view of the mapping, not a copy; a misaligned one an aligned copy
        assert got.ctypes.data % got.dtype.alignment == 0
        assert isinstance(got.base, mmap.mmap) == (offsets[name] % got.dtype.alignment == 0), name
        assert not got.flags.writeable
    def root(a):
        while isinstance(a, np.ndarray):
            a = a.base
        return a
    assert isinstance(root(prog.initializers["w1"]), mmap.mmap) and isinstance(root(prog.initializers["idx"]), bytes)
    from apollo_py.ir.graph import ConstArray       # immutable: the graph's constants share them
    assert all(ConstArray(a).array is a for a in prog.initializers.values())
    plain = _plain(path, monkeypatch)
    assert [n.name for n in plain.nodes] == [n.name for n in prog.nodes] and plain.inputs == prog.inputs
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(apollo_py.jit(path, target="reference")(x), (x @ w1 + b1)[:, idx], rtol=1e-5, atol=1e-6)


def _short_payload(m):
    m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]


def _duplicate_name(m):
    m.graph.initializer[1].name = "w1"


def _typed_and_raw(m):
    m.graph.initializer[0].float_data.append(1.0)


def _unnamed(m):
    m.graph.initializer[0].name = ""


def _bad_node(m):
    del m.graph.node[0].input[1]


def _dangling(m):
    m.graph.node[1].input[1] = "nowhere"


@pytest.mark.parametrize("break_it", [_short_payload, _duplicate_name, _typed_and_raw, _unnamed, _bad_node, _dangling])
def test_a_broken_model_raises_what_the_plain_load_raises(tmp_path, monkeypatch, break_it):
    m, _ = _mlp()
    break_it(m)
    path = str(tmp_path / "bad.onnx")
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    want = _plain(path, monkeypatch)
    assert isinstance(want, ModelLoadError), break_it.__name__
    with pytest.raises(ModelLoadError) as e:
        load_onnx(path)
    assert str(e.value) == str(want)


def test_files_it_does_not_apply_to_load_the_plain_way(tmp_path):
    m, _ = _mlp(ir_version=3)                   # initializers must be inputs there
    path = tmp_path / "ir3.onnx"
    onnx.save(m, str(path))
    assert onnx_file.read_stripped(str(path)) is None
    m, _ = _mlp()
    blob = m.SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(blob[:len(blob) - 10])
    assert onnx_file.read_stripped(str(tmp_path / "cut.onnx")) is None
    (tmp_path / "empty.onnx").write_bytes(b"")
    assert onnx_file.read_stripped(str(tmp_path / "empty.onnx")) is None
    with pytest.raises(ModelLoadError):
        load_onnx(str(tmp_path / "cut.onnx"))


def test_the_check_proto_declares_left_out_weights_as_inputs(tmp_path):
    m, (w1, b1, idx) = _mlp()
    m.graph.input.append(helper.make_tensor_value_info("b1", TensorProto.FLOAT, [8]))   # also an input
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    prog, check, weights = onnx_file.read_stripped(str(path))
    c = onnx.ModelProto()
    c.ParseFromString(check)
    assert not c.graph.initializer and not any(t.raw_data for t in prog.graph.initializer)
    types = {vi.name: (vi.type.tensor_type.elem_type, [d.dim_value for d in vi.type.tensor_type.shape.dim])
             for vi in c.graph.input}
    assert types == {"x": (TensorProto.FLOAT, [3, 16]), "b1": (TensorProto.FLOAT, [8]),
                     "w1": (TensorProto.FLOAT, [16, 8]), "idx": (TensorProto.INT64, [3])}
    onnx.checker.check_model(check)
    assert set(weights) == {"w1", "b1", "idx"}
