"""LLVM back end: streaming (non-temporal) stores of large outputs (codegen/nontemporal.py)."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from apollo_py import jit
from apollo_py.codegen import loopir as L
from apollo_py.codegen import nontemporal as NT
from apollo_py.codegen.llvm import compile_llvm, host, render_llvm
from apollo_py.codegen.loopir import If, Kernel, Param, Store, Var, for_, lt
from apollo_py.runtime.memory import aligned_empty

import codegen_kernels as K

BIG_ROWS, COLS = NT.NT_MIN_BYTES // (4 * 128), 128     # an output of exactly NT_MIN_BYTES


def _x86_attrs() -> str:
    attrs = host().cpu_attrs
    if "+sse2" not in attrs:
        pytest.skip("streaming stores are rendered for x86 hosts only")
    return attrs


def _unaligned(n: int) -> np.ndarray:
    """A float32 array of n elements that is 4 bytes off a 64-byte boundary."""
    block = aligned_empty((n + 16,), np.float32)
    return block[1:n + 1]


def _bcast_inputs(rng, m, n):
    a = rng.standard_normal(m * n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = rng.standard_normal(m).astype(np.float32)
    return a, b, c


def test_large_output_gets_an_nt_impl_and_aligned_and_unaligned_outputs_match_numpy(rng):
    attrs = _x86_attrs()
    k = K.broadcast_add_mul(BIG_ROWS, COLS)
    assert NT.nontemporal_params(k) == ("o",)
    text = render_llvm(k, attrs)
    assert "@bcast_add_mul.impl.nt(" in text and "call void @llvm.x86.sse.sfence()" in text
    ck = compile_llvm(k)
    assert ck.ir.count("!nontemporal") >= 1
    # the wrapper calls the NT impl only when the output pointer is 64-byte aligned
    wrapper = ck.ir[ck.ir.index("define void @bcast_add_mul("):]
    assert "and i64" in wrapper and ", 63" in wrapper and "@bcast_add_mul.impl.nt(" in wrapper
    a, b, c = _bcast_inputs(rng, BIG_ROWS, COLS)
    want = K.ref_broadcast_add_mul(a, b, c, BIG_ROWS, COLS)
    aligned = aligned_empty((BIG_ROWS * COLS,), np.float32)
    ck([a, b, c, aligned])
    np.testing.assert_allclose(aligned, want, rtol=1e-6, atol=0)
    off = _unaligned(BIG_ROWS * COLS)
    assert off.ctypes.data % 64 != 0
    ck([a, b, c, off])
    np.testing.assert_array_equal(off, aligned)   # the two impls compute the same numbers
    # a chunk of the parallel loop (as the thread pool runs it) writes only its rows
    part = aligned_empty((BIG_ROWS * COLS,), np.float32)
    part[:] = -1.0
    ck([a, b, c, part], 3, 7)
    np.testing.assert_array_equal(part[3 * COLS:7 * COLS], aligned[3 * COLS:7 * COLS])
    assert (part[:3 * COLS] == -1.0).all() and (part[7 * COLS:] == -1.0).all()


def test_small_or_reread_or_misaligned_outputs_render_no_nt_stores():
    attrs = _x86_attrs()
    small = K.broadcast_add_mul(BIG_ROWS // 4, COLS)            # 8 MiB out, 16 MiB moved
    assert NT.nontemporal_params(small) == ()
    # 16 MiB out of a kernel that moves 32 MiB: past the last-level cache, streamed
    assert NT.nontemporal_params(K.broadcast_add_mul(BIG_ROWS // 2, COLS)) == ("o",)
    assert NT.nontemporal_params(K.broadcast_add_mul(BIG_ROWS // 2, COLS), NT.NT_MIN_BYTES) == ()
    text = render_llvm(small, attrs)
    assert ".impl.nt" not in text and "sfence" not in text and "nontemporal" not in text
    assert "!nontemporal" not in compile_llvm(small).ir
    big = K.broadcast_add_mul(BIG_ROWS, COLS)
    assert ".impl.nt" not in render_llvm(big)                   # no target attributes: no x86
    # the softmax kernel reads its output back (sum and scale passes): never streamed
    assert NT.nontemporal_params(K.softmax_rows(BIG_ROWS, COLS), 0) == ()

    x, o = Param("x", "float32", 1 << 22), Param("o", "float32", 1 << 22)
    i, j = Var("i"), Var("j")

    def nest(index, cols=128, kind="vector", guard=False):
        st = Store(o, index(i, j, cols), x[i * cols + j])
        if guard:
            st = If(lt(j, 100), st)
        body = for_("i", 0, (1 << 22) // cols, for_("j", 0, cols, st, kind), "parallel")
        return Kernel("k", (x, o), body, "i", (1 << 22) // cols)

    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j), 0) == ("o",)
    # an innermost serial loop streams too (LLVM vectorises it; if not, nothing is marked),
    # a loop with a loop inside it, or an unrolled one, does not
    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j, kind="serial"), 0) == ("o",)
    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j, kind="unroll"), 0) == ()
    inner = for_("j", 0, 128, Store(o, i * 128 + j, x[i * 128 + j]), "vector")
    outer_store = Store(o, i, x[i])      # unit stride in i, but i's loop holds j's loop
    mixed = Kernel("m", (x, o), for_("i", 0, 1 << 15, L.block(inner, outer_store), "serial"), None, None)
    assert NT.nontemporal_params(mixed, 0) == ()
    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j, cols=120), 0) == ()   # 120 % 16
    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j + 1), 0) == ()         # base + 1
    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j * 2), 0) == ()         # stride 2
    assert NT.nontemporal_params(nest(lambda i, j, c: i * c + j, guard=True), 0) == ()
    # a loop computing a transcendental per element keeps ordinary stores (measured slower)
    assert NT.nontemporal_params(K.bias_gelu(BIG_ROWS, COLS), 0) == ()
    st = Store(o, i * 128 + j, L.Un("exp", x[i * 128 + j]))
    expo = Kernel("e", (x, o), for_("i", 0, 1 << 15, for_("j", 0, 128, st, "vector"), "parallel"), "i", 1 << 15)
    assert NT.nontemporal_params(expo, 0) == ()
    # a flat (non-nested) parallel loop is not a vector loop
    flat = Kernel("f", (x, o), for_("i", 0, 1 << 22, Store(o, i, x[i]), "parallel"), "i", 1 << 22)
    assert NT.nontemporal_params(flat, 0) == ()


def _softmax_model(shape):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    graph = helper.make_graph([node], "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _softmax_ref(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_softmax_graph_streams_its_output_and_out_views_stay_correct(rng):
    _x86_attrs()
    shape = (BIG_ROWS // 128, 128, COLS)
    x = (rng.standard_normal(shape) * 2.0).astype(np.float32)
    f = jit(_softmax_model(shape), target="cpu")
    y = f(x=x)
    want = _softmax_ref(x)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-12)
    kernels = [s.compiled for s in f.specialization({"x": shape}).steps if hasattr(s, "compiled")]
    # (the kernel may come from the disk cache, whose key hashes this rendered text)
    assert any(".impl.nt(" in render_llvm(kc.kernel, host().cpu_attrs) for kc in kernels)
    out = _unaligned(x.size).reshape(shape)              # a 4-byte-offset out= array
    f(x=x, out=out)
    np.testing.assert_array_equal(out, y)


def test_big_softmax_kernel_asm_has_a_streaming_vector_store():
    _x86_attrs()
    feats = host().features.split(",")
    if "+avx512f" in feats:
        reg = "zmm"
    elif "+avx2" in feats:
        reg = "ymm"
    else:
        pytest.skip("host has neither AVX-512 nor AVX2")
    shape = (BIG_ROWS // 128, 128, COLS)
    f = jit(_softmax_model(shape), target="cpu")
    f(x=np.zeros(shape, np.float32))
    kernels = [s.compiled for s in f.specialization({"x": shape}).steps if hasattr(s, "compiled")]
    asm = "\n".join(compile_llvm(kc.kernel).asm for kc in kernels)   # fresh: a cached one has no IR
    assert any(ln.strip().startswith("vmovntps") and reg in ln for ln in asm.splitlines())
    assert "sfence" in asm


IR = """define internal void @k.impl.nt(ptr noalias align 64 %p.o, ptr noalias %p.w, i64 %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i2, %loop ]
  %q = phi ptr [ %p.o, %entry ], [ %q2, %loop ]
  %g = getelementptr inbounds nuw float, ptr %p.o, i64 %i
  store <16 x float> zeroinitializer, ptr %g, align 64
  %h = getelementptr inbounds i8, ptr %g, i64 64
  store <16 x float> zeroinitializer, ptr %h, align 64, !tbaa !0
  store <16 x float> zeroinitializer, ptr %q, align 4
  store float 0.0, ptr %g, align 64
  %w = getelementptr inbounds float, ptr %p.w, i64 %i
  store <16 x float> zeroinitializer, ptr %w, align 64
  %q2 = getelementptr inbounds i8, ptr %q, i64 64
  store <8 x float> zeroinitializer, ptr %q2, align 32
  %i2 = add i64 %i, 16
  %c = icmp ult i64 %i2, %n
  br i1 %c, label %loop, label %exit
exit:
  ret void
}
!0 = !{!"x"}
"""


def test_mark_nontemporal_marks_aligned_vector_stores_derived_from_streamed_params_only():
    text, n = NT.mark_nontemporal(IR, "k.impl.nt", ["o"])
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("store")]
    marked = [("!nontemporal !1" in ln) for ln in lines]
    # aligned <16 x float> at %g and %h (through a gep of a gep), the phi-carried pointer's
    # <8 x float> at align 32; not: align 4, a scalar, a pointer into another param
    assert marked == [True, True, False, False, False, True] and n == 3
    assert text.rstrip().endswith("!1 = !{i32 1}")
    assert "!nontemporal !1, !tbaa !0" in text
    assert NT.mark_nontemporal(IR, "absent", ["o"]) == (IR, 0)
    assert NT.mark_nontemporal(IR, "k.impl.nt", ["w"])[1] == 1


def test_layernorm_past_the_cache_streams_its_output_and_matches_numpy(rng):
    """LayerNorm [8192, 768]: 24 MiB out, 48 MiB moved -- streamed (NT_MIN_OUTPUT_BYTES), though
    its scaling loop keeps private scalars (a serial loop) and its output is under NT_MIN_BYTES."""
    _x86_attrs()
    n, d = 8192, 768
    x = rng.standard_normal((n, d)).astype(np.float32)
    g = (rng.standard_normal(d) * 0.5 + 1).astype(np.float32)
    b = (rng.standard_normal(d) * 0.1).astype(np.float32)
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (n, d))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (n, d))],
                              initializer=[helper.make_tensor("g", TensorProto.FLOAT, (d,), g),
                                           helper.make_tensor("b", TensorProto.FLOAT, (d,), b)])
    f = jit(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), target="cpu")
    y = f(x=x)
    x64 = x.astype(np.float64)
    m = x64.mean(-1, keepdims=True)
    want = (x64 - m) / np.sqrt(((x64 - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    kernels = [s.compiled for s in f.specialization({"x": (n, d)}).steps if hasattr(s, "compiled")]
    assert len(kernels) == 1 and NT.nontemporal_params(kernels[0].kernel) == ("y",)
    assert "movntps" in compile_llvm(kernels[0].kernel).asm
    out = _unaligned(x.size).reshape(n, d)              # the ordinary impl for a 4-byte-offset out=
    f(x=x, out=out)
    np.testing.assert_array_equal(out, y)
