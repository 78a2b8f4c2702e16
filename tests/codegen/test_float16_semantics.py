"""float16 on target="cpu" follows numpy's float16 semantics, which target="reference" runs.

numpy rounds every float16 result to float16; its float16 sum accumulates in float32 when the
reduced axes are the trailing (contiguous) ones and rounds at every step otherwise.  Kernels
compute in float32, so they round float16 intermediates kept in registers (``round_f16``) and
keep a float32 accumulator only for the contiguous case.  The data below make the two
semantics give different float16 results, and make the float32 arithmetic exact, so the
comparisons are exact (rtol=0, atol=0).
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import apollo_py
from apollo_py.codegen import loopir as L
from apollo_py.codegen.c import compile_c, find_cc
from apollo_py.codegen.interp import interpret
from apollo_py.codegen.llvm import compile_llvm
from apollo_py.errors import CompileError

F16 = TensorProto.FLOAT16


def _model(nodes, inputs, outputs):
    g = helper.make_graph(nodes, "f16", [helper.make_tensor_value_info(n, F16, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F16, None) for n in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _run_both(model, *args):
    return [apollo_py.jit(model, target=t).run(*args)[0] for t in ("reference", "cpu")]


def _round_kernel(n: int) -> L.Kernel:
    """o[i] = round_f16(a[i] * b[i]) + c[i], all float32 buffers."""
    a, b, c, o = (L.Param(x, "float32", n) for x in "abco")
    i = L.Var("i")
    body = L.for_("i", 0, n, L.Store(o, i, L.Un("round_f16", a[i] * b[i]) + c[i]), "vector")
    return L.Kernel("round_f16_k", (a, b, c, o), body)


def test_round_f16_renderers_agree_with_numpy(rng):
    n = 257
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    c = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    want = (a * b).astype(np.float16).astype(np.float32) + c
    assert not np.array_equal(want, a * b + c)          # the rounding is visible
    runs = [("llvm", compile_llvm), ("interp", None)] + ([("c", compile_c)] if find_cc() else [])
    for name, compile_fn in runs:
        arrays = [a, b, c, np.empty(n, np.float32)]
        if compile_fn is None:
            interpret(_round_kernel(n), arrays)
        else:
            try:
                compile_fn(_round_kernel(n))(arrays)
            except CompileError as exc:   # a C compiler without _Float16
                pytest.skip(f"{name}: {exc}")
        np.testing.assert_allclose(arrays[3], want, rtol=0, atol=0, err_msg=name)


def test_fused_elementwise_chain_rounds_every_op(rng):
    # (a * b + c) / d - a, one fused kernel on cpu: numpy rounds after each of the four ops
    shape = [8, 96]
    a, b, c = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
    d = (rng.random(shape) + 0.5).astype(np.float16)
    m = _model([helper.make_node("Mul", ["a", "b"], ["ab"]), helper.make_node("Add", ["ab", "c"], ["s"]),
                helper.make_node("Div", ["s", "d"], ["q"]), helper.make_node("Sub", ["q", "a"], ["y"])],
               [(x, shape) for x in "abcd"], ["y"])
    want = (a * b + c) / d - a
    f32 = ((a.astype(np.float32) * b + c) / d - a).astype(np.float16)
    assert not np.array_equal(want, f32)                # float32 intermediates would differ
    ref, cpu = _run_both(m, a, b, c, d)
    np.testing.assert_allclose(ref.astype(np.float32), want.astype(np.float32), rtol=0, atol=0)
    np.testing.assert_allclose(cpu.astype(np.float32), want.astype(np.float32), rtol=0, atol=0)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_reduce_sum_accumulates_as_numpy(rng, axis):
    # multiples of 2**-10 below 4: float32 sums of 300 of them are exact, float16 steps are not
    x = (rng.integers(0, 4096, size=(6, 300, 37)) / 1024).astype(np.float16)
    if axis == -1:
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
    m = _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
               [("x", list(x.shape))], ["y"])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([axis], np.int64), "axes"))
    want = x.sum(axis=axis)
    exact = x.astype(np.float32).sum(axis=axis).astype(np.float16)
    assert np.array_equal(want, exact) == (axis == -1)  # numpy: float32 only when contiguous
    ref, cpu = _run_both(m, x)
    np.testing.assert_allclose(ref.astype(np.float32), want.astype(np.float32), rtol=0, atol=0)
    np.testing.assert_allclose(cpu.astype(np.float32), want.astype(np.float32), rtol=0, atol=0)


def test_fused_normalise_by_row_sum(rng):
    # y = x / sum(x * x, -1): the square and the row sum live in registers inside one kernel
    x = (rng.integers(1, 2048, size=(5, 150)) / 1024).astype(np.float16)
    m = _model([helper.make_node("Mul", ["x", "x"], ["sq"]),
                helper.make_node("ReduceSum", ["sq", "axes"], ["s"], keepdims=1),
                helper.make_node("Div", ["x", "s"], ["y"])], [("x", [5, 150])], ["y"])
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    want = x / (x * x).sum(axis=-1, keepdims=True)
    ref, cpu = _run_both(m, x)
    np.testing.assert_allclose(ref.astype(np.float32), want.astype(np.float32), rtol=0, atol=0)
    np.testing.assert_allclose(cpu.astype(np.float32), want.astype(np.float32), rtol=0, atol=0)
