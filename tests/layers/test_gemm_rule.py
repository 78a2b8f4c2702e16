"""``Options.gemm == "auto"`` (layers/gemm_lowering.py): which side runs a float32 matmul, and
the BLAS facts the rule reads (codegen/blas_info.py).  The rule depends on the machine (the
host's vector width, the kernel numpy's OpenBLAS picked), so the expectations are computed from
the same facts, and the machine-dependent branch is pinned by monkeypatching them."""
import numpy as np
import pytest

from apollo_py.codegen import blas_info
from apollo_py.codegen.gemm import host_blocking
from apollo_py.layers import gemm_lowering as gl

BIG = ((1024, 1024), (1024, 1024))      # 2^30 multiply-adds, run-time right operand


def test_blas_facts_are_consistent():
    core, lanes = blas_info.blas_core(), blas_info.blas_vector_floats()
    assert isinstance(core, str)
    assert lanes is None if not core else lanes == (16 if core in blas_info.AVX512_CORES else 8)


@pytest.mark.parametrize("lanes,want_generated", [(8, None), (16, False), (None, False)])
def test_runtime_right_operand_follows_the_vector_widths(monkeypatch, lanes, want_generated):
    monkeypatch.setattr(blas_info, "blas_vector_floats", lambda: lanes)
    if want_generated is None:      # an AVX2 BLAS: generated exactly where the host is wider
        want_generated = host_blocking().vl > 8
    assert (gl.auto_blas_reason(*BIG, False) == "") is want_generated
    # below RUNTIME_B_MNK a run-time right operand stays on BLAS whatever the widths
    assert gl.auto_blas_reason((64, 512), (512, 256), False) != ""


def test_the_other_branches_do_not_read_the_blas(monkeypatch):
    monkeypatch.setattr(blas_info, "blas_vector_floats", lambda: 8)
    assert gl.auto_blas_reason((2, 3, 64, 32), (2, 3, 32, 64), False) == ""      # batched: generated
    assert "thin" in gl.auto_blas_reason((1024, 1024), (1024, 1), True)        # N < THIN_N: BLAS
    assert "small" in gl.auto_blas_reason((8, 8), (8, 64), True)               # under SMALL_MNK: BLAS
    assert gl.auto_blas_reason((128, 768), (768, 768), True) == ""             # a weight: generated


def test_compiled_runtime_right_operand_matches_numpy(monkeypatch):
    """The generated side of the rule, through the compiler: x @ y with y an input, 2^25
    multiply-adds, on 2 threads, against numpy."""
    import apollo_py as ap
    from onnx import TensorProto, helper
    monkeypatch.setattr(blas_info, "blas_vector_floats", lambda: 4)
    m, k, n = 128, 512, 512
    g = helper.make_graph([helper.make_node("MatMul", ["x", "y"], ["z"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [m, n])])
    f = ap.jit(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), options=ap.Options(num_threads=2))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    z = f(x, y)
    np.testing.assert_allclose(z, x.astype(np.float64) @ y, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    assert ("auto: right operand computed at run time" in str(f.plan)) is (host_blocking().vl > 4)
