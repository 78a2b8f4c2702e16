"""Issue #16 item 5: bad input comes out as an ApolloError subclass naming what is wrong, never
as a raw Python exception (each case escaped raw before its fix)."""
import json
import os

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import InputError, OptionsError, ShapeError


def _double():
    b = ap.GraphBuilder("double")
    x = b.input("x", (2, 3))
    return b.build([x + x])


@pytest.mark.parametrize("value, why", [
    ([[1, 2, 3], [1, 2]], "inhomogeneous"),
    ([["a", "b", "c"], ["d", "e", "f"]], "could not convert string"),
])
def test_ragged_or_string_list_input_is_input_error(value, why):
    m = ap.jit(_double(), target="reference")
    with pytest.raises(InputError, match=f"input 'x'.*{why}"):
        m(value)
    np.testing.assert_array_equal(m([[1, 2, 3], [4, 5, 6]]),
                                  np.array([[2, 4, 6], [8, 10, 12]], np.float32))


@pytest.mark.parametrize("eq, why", [("ij,jk->ik->i", "more than one '->'"),
                                      ("...i...,i", "more than one '...'")])
def test_malformed_einsum_equation_is_shape_error(eq, why):
    b = ap.GraphBuilder("e")
    x, y = b.input("x", (2, 2)), b.input("y", (2, 2))
    from apollo_py.ops.compound_einsum import einsum
    with pytest.raises(ShapeError, match=why):
        einsum(b, eq, [x, y])


@pytest.mark.parametrize("field, value", [
    ("target", "bogus"), ("gemm", "bogus"), ("gemm", "blas "), ("schedule_budget", 0),
    ("schedule_budget", 1.5), ("schedule_timeout", -1), ("num_threads", 0), ("num_threads", True),
    ("tile_sizes", (4, 0)), ("cache_dir", 3), ("progress", "yes"), ("preprocess", None),
    ("feedback_path", 7), ("model_name", None), ("max_memory", 0), ("max_memory", 1.5),
])
def test_options_fields_are_validated(field, value):
    with pytest.raises(OptionsError, match=f"Options.{field} must be"):
        ap.Options(**{field: value})
    with pytest.raises(OptionsError, match=f"Options.{field}"):
        ap.Options().replace(**{field: value})


@pytest.mark.parametrize("target", ["cpu", "reference", "cuda", "cuda-emu"])
def test_options_accept_every_target(target):
    assert ap.Options(target=target).target == target


def test_jit_with_bad_target_is_options_error():
    with pytest.raises(OptionsError, match="target"):
        ap.jit(_double(), target="gpu")


def test_feedback_log_skips_bad_utf8_and_non_objects(tmp_path):
    from apollo_py.feedback.log import read_events
    p = tmp_path / "f.jsonl"
    p.write_bytes(b'{"event":"a","n":1}\n\xff\xfe\n[1,2]\n"text"\n7\n{"event":"b"}\n{"event":"a","n":2}\n')
    assert read_events(str(p)) == [{"event": "a", "n": 1}, {"event": "b"}, {"event": "a", "n": 2}]
    assert [e["n"] for e in read_events(str(p), "a")] == [1, 2]


@pytest.mark.parametrize("meta", ["[1, 2]", '"text"', "3", "null"])
def test_cache_json_that_is_not_an_object_is_a_miss(tmp_path, meta):
    from apollo_py.cache import PieceCache
    c = PieceCache(str(tmp_path))
    c.put("k1", b"payload", {"x": 1})
    path = c._path("k1")
    with open(path, "rb") as f:
        f.readline()
        payload = f.read()
    with open(path, "wb") as f:
        f.write(meta.encode() + b"\n" + payload)
    fresh = PieceCache(str(tmp_path))
    assert fresh.get("k1") is None
    fresh.put("k1", b"payload2", {"x": 2})
    assert PieceCache(str(tmp_path)).get("k1")[0] == b"payload2"


def test_machine_json_with_wrong_types_is_remeasured(tmp_path):
    from apollo_py.machine import load_machine, machine_path
    for doc in ({"notes": [1], "figures": {}}, [1], "x", {"notes": {"format": 1, "hardware": 3}}):
        with open(machine_path(str(tmp_path)), "w") as f:
            json.dump(doc, f)
        assert load_machine(str(tmp_path)) is None


def _save_model(tmp_path):
    from onnx import TensorProto, helper, save
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x], [y])
    path = str(tmp_path / "neg.onnx")
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    np.save(str(tmp_path / "x.npy"), np.array([1.5, -2.0], np.float32))
    return path


def test_cli_run_out_into_missing_directory_creates_it(tmp_path, capsys):
    from apollo_py.cli import main
    model = _save_model(tmp_path)
    out = tmp_path / "new" / "dir"
    rc = main(["--cache-dir", str(tmp_path / "c"), "run", model, "--input", f"x={tmp_path / 'x.npy'}",
               "--out", str(out)])
    assert rc == 0
    np.testing.assert_array_equal(np.load(out / "y.npy"), np.array([-1.5, 2.0], np.float32))


def test_cli_run_out_that_cannot_be_created_is_one_error_line(tmp_path, capsys):
    from apollo_py.cli import main
    model = _save_model(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = main(["--cache-dir", str(tmp_path / "c"), "run", model, "--input", f"x={tmp_path / 'x.npy'}",
               "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --out") and "Traceback" not in err


def test_cli_bad_target_is_one_error_line(tmp_path, capsys):
    from apollo_py.cli import main
    rc = main(["--target", "gpu", "explain", _save_model(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "Options.target" in err and os.linesep not in err.strip()


def test_unwritable_cache_dir_warns_once_and_still_compiles(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    opts = ap.Options(target="cpu", cache_dir=str(blocker / "cache"), machine="conservative")
    b = ap.GraphBuilder("unwritable")
    x = b.input("x", (4, 8))
    y = b.exp(x) * 2.0 + x
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f = ap.jit(b.build([y]), options=opts)
        xv = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)
        np.testing.assert_allclose(f(xv), np.exp(xv) * 2 + xv, rtol=1e-6, atol=1e-6)
    msgs = [str(w.message) for w in seen if "cannot write the compile cache" in str(w.message)]
    assert len(msgs) == 1 and str(blocker / "cache") in msgs[0]


def test_library_bugs_are_not_swallowed_as_unknown_ops(monkeypatch):
    """Narrowed ``except Exception``: "no such op" is answered, a bug inside is raised."""
    from onnx.reference import ops as ref_ops
    from apollo_py.frontend.onnx_op import has_reference
    from apollo_py.layers import gemm_lowering
    assert has_reference("Relu", "", 17) and not has_reference("NoSuchOp", "", 17)
    assert not has_reference("Relu", "com.example", 1)

    def broken(*a, **k):
        raise ZeroDivisionError("bug inside the lookup")

    monkeypatch.setattr(ref_ops, "load_op", broken)
    with pytest.raises(ZeroDivisionError):
        has_reference("Relu", "", 17)
    b = ap.GraphBuilder("g")
    x = b.input("x", (2, 2))
    g = b.build([b.exp(x)])
    from apollo_py.ops import registry
    monkeypatch.setattr(registry, "get_op", broken)
    with pytest.raises(ZeroDivisionError):
        gemm_lowering._fusable(g.nodes[-1], g.types, (2, 2), set())


def _bomb(kind):
    from onnx import TensorProto, helper, numpy_helper
    shape = numpy_helper.from_array(np.array([10**6, 10**6], np.int64), "shape")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if kind == "ConstantOfShape":
        nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"],
                                  value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
                 helper.make_node("Add", ["c", "x"], ["y"])]
    elif kind == "Expand":
        nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Exp", ["e"], ["z"]),
                 helper.make_node("ReduceSum", ["z"], ["y"], keepdims=0)]
    else:
        nodes = [helper.make_node("Range", ["zero", "big", "one"], ["y"])]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        shape = numpy_helper.from_array(np.array(0, np.int64), "zero")
        inits = [shape, numpy_helper.from_array(np.array(10**12, np.int64), "big"),
                 numpy_helper.from_array(np.array(1, np.int64), "one")]
        g = helper.make_graph(nodes, kind, [x], [y], initializer=inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    g = helper.make_graph(nodes, kind, [x], [y], initializer=[shape])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("kind", ["ConstantOfShape", "Expand", "Range"])
def test_memory_bombs_are_resource_errors_before_allocating(kind):
    import time
    from apollo_py.errors import ResourceError
    t0 = time.perf_counter()
    with pytest.raises(ResourceError, match=f"node '{kind}_0' .*over Options.max_memory"):
        ap.jit(_bomb(kind), target="cpu", options=ap.Options(max_memory=2**30)).plan
    assert time.perf_counter() - t0 < 30


def test_memory_plan_over_max_memory_is_resource_error():
    from apollo_py.errors import ResourceError
    b = ap.GraphBuilder("plan")
    x = b.input("x", (256, 256))
    y = b.exp(b.matmul(x, x)) + 1.0
    g = b.build([b.reduce_sum(b.matmul(y, y), axes=(1,))])
    with pytest.raises(ResourceError, match="graph 'plan' .*over Options.max_memory"):
        ap.jit(g, options=ap.Options(max_memory=300_000)).plan
    xv = np.full((256, 256), 0.001, np.float32)
    f = ap.jit(g, options=ap.Options(max_memory=2**30))
    yv = np.exp(xv.astype(np.float64) @ xv) + 1.0
    np.testing.assert_allclose(f(xv), (yv @ yv).sum(axis=1), rtol=1e-4)
