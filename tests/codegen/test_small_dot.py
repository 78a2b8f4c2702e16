"""Tiny batched products as dot products (codegen/small_dot.py): DLRM's feature interaction
``stack @ transpose(stack)`` stored ``transpose(1, 2, 0)`` is one small-dot kernel step (the
transposes folded), matches onnxruntime; shapes it does not take stay on the generated GEMM."""
from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto, helper

import apollo_py
from apollo_py.codegen import small_dot
from apollo_py.codegen.gemm import CompiledGemm, OperandView, matmul_desc
from apollo_py.codegen.small_dot import CompiledSmallDot, compile_small_dot, dot_plan
from apollo_py.runtime.gemm_step import GemmStep


def _interaction(batch, f, d, out_perm=(1, 2, 0)):
    """``x [batch, f, d] -> x @ transpose(x, (0, 2, 1)) -> transpose(out_perm) -> y`` (+ 1, so the
    transposed result is not a graph output itself)."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "xt"], ["z"])]
    cur = "z"
    if out_perm is not None:
        nodes.append(helper.make_node("Transpose", ["z"], ["zt"], perm=list(out_perm)))
        cur = "zt"
    nodes += [helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])),
              helper.make_node("Add", [cur, "one"], ["y"])]
    g = helper.make_graph(nodes, "interaction", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, f, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model, x):
    import onnxruntime as ort
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _gemm_steps(f, x):
    exe = f.specialization({"x": x.shape})
    return [s for s in exe.steps if isinstance(s, GemmStep)]


@pytest.mark.parametrize("batch,f,d", [(64, 9, 64), (32, 16, 32), (48, 5, 128)])
def test_interaction_is_one_small_dot_step(batch, f, d):
    model = _interaction(batch, f, d)
    x = np.random.default_rng(batch + f).standard_normal((batch, f, d)).astype(np.float32)
    fn = apollo_py.jit(model, options=apollo_py.Options(num_threads=2))
    got = fn(x=x)
    np.testing.assert_allclose(got, _ort(model, x), rtol=1e-5, atol=1e-4)
    steps = _gemm_steps(fn, x)
    # pinned: the product is one small-dot step that reads x in place and stores transposed
    assert len(steps) == 1 and isinstance(steps[0].compiled, CompiledSmallDot)
    exe = fn.specialization({"x": x.shape})
    assert len(exe.steps) == 2       # the small-dot product and the add: both transposes folded
    assert "as dot products" in str(fn.plan)
    for _ in range(3):      # through the native driver
        np.testing.assert_array_equal(fn(x=x), got)


@pytest.mark.parametrize("batch,f,d,perm", [(65, 9, 64, (1, 2, 0)),     # batch not a multiple of VL
                                            (64, 9, 64, None),          # batch not innermost
                                            (64, 9, 40, (1, 2, 0)),      # K not a multiple of VL
                                            (64, 27, 64, (1, 2, 0))])    # 729 dot products a row pair
def test_other_shapes_stay_on_the_gemm(batch, f, d, perm):
    model = _interaction(batch, f, d, perm)
    x = np.random.default_rng(1).standard_normal((batch, f, d)).astype(np.float32)
    fn = apollo_py.jit(model, options=apollo_py.Options(num_threads=2))
    np.testing.assert_allclose(fn(x=x), _ort(model, x), rtol=1e-5, atol=1e-4)
    steps = _gemm_steps(fn, x)
    assert len(steps) == 1 and isinstance(steps[0].compiled, CompiledGemm)


def _desc(batch=64, f=9, k=64, **kw):
    d = matmul_desc("gemm_t", (batch, f, k), (batch, k, f), (batch, f, f), "h", outputs=("h",),
                    out_dtypes=("float32",))
    return replace(d, a_value="x", b_value="x", b_view=OperandView.transposed((batch, f, k), (0, 2, 1)),
                   out_perm=(1, 2, 0), stored_as=("y",), **kw)


def test_plan_strides_and_reasons():
    p, why = dot_plan(_desc(), vl=16)
    assert why == "" and (p.a_bs, p.a_is, p.b_bs, p.b_js, p.o_is, p.o_js) == (576, 64, 576, 64, 576, 64)
    assert p.groups == 4 * 81
    assert dot_plan(_desc(b_const=True), vl=16)[0] is None
    assert dot_plan(replace(_desc(), out_perm=None), vl=16)[1] == "result not stored batch-innermost"
    assert dot_plan(replace(_desc(), b_view=None), vl=16)[1] == "B not the transpose of row-major rows"
    assert "sizes" in dot_plan(_desc(batch=40), vl=16)[1]


def test_kernel_against_numpy_vl8_butterfly(monkeypatch):
    """The 8-lane form (AVX2 hosts) of the reduction: lane l of the stored vector is batch l's."""
    monkeypatch.setattr(small_dot, "_vl", lambda: 8)
    d = _desc(batch=24, f=3, k=16)
    cg = compile_small_dot(d)
    assert cg.plan.vl == 8
    x = np.random.default_rng(2).standard_normal((24, 3, 16)).astype(np.float32)
    out = np.empty((3, 3, 24), np.float32)
    cg.run(None, x, x, (), [out])
    np.testing.assert_allclose(out, (x @ x.transpose(0, 2, 1)).transpose(1, 2, 0), rtol=1e-5, atol=1e-5)
