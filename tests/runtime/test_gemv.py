"""The batch-1 matrix-vector product with a constant weight (codegen/gemv.py) against onnxruntime
(rtol 1e-4): MatMul and Gemm (transB), K odd and even, N not a multiple of 16 or of the 64-column
panel, bias / activation / residual epilogues, on the pool's two threads and on the calling
thread (inside the native driver); which products take it (plan pins)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import Options
from apollo_py.codegen import gemv as GV


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    """The kernel is off by default (codegen/gemv.py ENABLED: not yet measured on a quiet box)."""
    monkeypatch.setattr(GV, "ENABLED", True)


def _ort(m, feeds):
    import onnxruntime as ort
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _model(k, n, op="MatMul", act=None, residual=False, m=1, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k) if op == "Gemm" else (k, n)) * 0.05).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])]
    if op == "Gemm":
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1)]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m0"]), helper.make_node("Add", ["m0", "b"], ["h"])]
    last = "h"
    if act:
        nodes.append(helper.make_node(act, [last], ["a"]))
        last = "a"
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [m, n]))
        nodes.append(helper.make_node("Add", [last, "r"], ["y"]))
        last = "y"
    g = helper.make_graph(nodes, "gemv", inputs, [helper.make_tensor_value_info(last, TensorProto.FLOAT, [m, n])],
                          inits)
    feeds = {"x": rng.standard_normal((m, k)).astype(np.float32)}
    if residual:
        feeds["r"] = rng.standard_normal((m, n)).astype(np.float32)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), feeds


CASES = {   # name -> (K, N, op, activation, residual)
    "classifier_gemm": (640, 1000, "Gemm", None, False),          # N: 15 panels + 40 columns
    "odd_k_hardswish": (521, 560, "MatMul", "HardSwish", False),
    "n_not_16_relu_residual": (384, 777, "MatMul", "Relu", True),
    "one_panel_sigmoid": (4099, 64, "Gemm", "Sigmoid", False),    # fewer panels than tiles
    "k_one": (1, 300000, "MatMul", None, False),                  # no k pair, the odd k alone
}


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "calling_thread"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gemv_matches_onnxruntime(case, pool, monkeypatch):
    k, n, op, act, res = CASES[case]
    if not pool:
        monkeypatch.setattr(GV, "POOL_WEIGHT_BYTES", 1 << 40)
    m, feeds = _model(k, n, op, act, res)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = _ort(m, feeds)
    got = f(**feeds)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    gemms = [s for s in f.plan.kernels if "matrix-vector product" in s.reason]
    assert len(gemms) == 1, str(f.plan)
    from apollo_py.runtime.gemm_step import GemmStep
    exe = f.specialization({v: a.shape for v, a in feeds.items()})
    step, = [s for s in exe.steps if isinstance(s, GemmStep)]
    assert type(step.compiled).__name__ == "CompiledGemv" and step.compiled.inline is (not pool)
    driven = [s for seg in exe._program.segments for s in seg.steps if isinstance(s, GemmStep)]
    assert driven == ([] if pool else [step])       # one-thread GEMVs are native driver steps
    if pool:
        assert step.compiled.layout.tiles == min(step.compiled.layout.npan, 8)
    feeds2 = {v: a + 1 for v, a in feeds.items()}
    np.testing.assert_allclose(f(**feeds2), _ort(m, feeds2), rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_packed_layout_is_contiguous_panels():
    """``[panel][K][NR]``: column ``j`` of row ``k`` at ``(j // NR) * K * NR + k * NR + j % NR``,
    the last panel zero padded; tiles are runs of consecutive panels covering all of them."""
    from apollo_py.codegen.gemm import matmul_desc
    d = matmul_desc("gemm_t", (1, 37), (37, 150), (1, 150), "y", a_value="x", b_value="w", b_const=True,
                    outputs=("y",), out_dtypes=("float32",))
    cg = GV.compile_gemv(d, 2)
    w = np.arange(37 * 150, dtype=np.float32).reshape(37, 150)
    p = cg.packed_b(w)
    nr = cg.blocking.nr
    assert p.size == cg.layout.npan * 37 * nr and p.ctypes.data % 64 == 0
    pv = p.reshape(cg.layout.npan, 37, nr)
    np.testing.assert_array_equal(pv[1, 5, 3], w[5, nr + 3])
    assert not pv[-1, :, 150 - (cg.layout.npan - 1) * nr:].any()
    first = cg.layout.first
    assert first[0] == 0 and first[-1] == cg.layout.npan and all(a < b for a, b in zip(first, first[1:]))
    assert cg.packed_b(w) is p


def test_which_products_take_it(monkeypatch):
    """One row times a constant weight of at least MIN_WEIGHT_BYTES; not two rows, not a run-time
    right operand, not with ENABLED off (the default)."""
    from dataclasses import replace

    from apollo_py.codegen.gemm import matmul_desc

    def desc(m, k, n, const=True):
        return matmul_desc("gemm_t", (m, k), (k, n), (m, n), "y", a_value="x", b_value="w", b_const=const)
    assert "1280x1000 weight" in GV.gemv_reason(desc(1, 1280, 1000))
    assert GV.gemv_reason(desc(2, 1280, 1000)) == ""
    assert GV.gemv_reason(desc(1, 1280, 1000, const=False)) == ""
    assert GV.gemv_reason(desc(1, 64, 64)) == ""                        # 16 KB: the GEMM
    assert GV.gemv_reason(replace(desc(1, 1280, 1000), out_perm=(1, 0))) == ""
    assert GV.gemv_reason(desc(1, 1280, 1000), "cuda") == ""
    monkeypatch.setattr(GV, "ENABLED", False)
    assert GV.gemv_reason(desc(1, 1280, 1000)) == ""
    m, feeds = _model(640, 1000, "Gemm")
    f = apollo_py.jit(m, options=Options(num_threads=2))
    assert "matrix-vector" not in str(f.plan) and "generated GEMM" in str(f.plan), str(f.plan)
    np.testing.assert_allclose(f(**feeds), _ort(m, feeds), rtol=1e-4, atol=1e-4)
