"""LLVM back end: hand-built kernels against numpy, IR properties."""
import re

import numpy as np
import pytest

from apollo_py.codegen import loopir as L
from apollo_py.codegen.llvm import compile_llvm, render_llvm
from apollo_py.errors import InputError

import codegen_kernels as K


def test_broadcast_add_mul(rng):
    m, n = 37, 101
    ck = compile_llvm(K.broadcast_add_mul(m, n))
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in (m * n, n, m))
    o = np.empty(m * n, np.float32)
    ck([a, b, c, o])
    np.testing.assert_allclose(o, K.ref_broadcast_add_mul(a, b, c, m, n), rtol=1e-6, atol=1e-6)


def test_bias_gelu(rng):
    m, n = 64, 300
    ck = compile_llvm(K.bias_gelu(m, n))
    x = (rng.standard_normal(m * n) * 4).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    o = np.empty_like(x)
    ck([x, b, o])
    ref = K.ref_gelu_tanh((x.reshape(m, n) + b).ravel())
    np.testing.assert_allclose(o, ref, rtol=2e-6, atol=1e-6)


def test_bias_gelu_float16_storage(rng):
    m, n = 8, 64
    ck = compile_llvm(K.bias_gelu(m, n, "float16"))
    x = rng.standard_normal(m * n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    o = np.empty_like(x)
    ck([x, b, o])
    ref = K.ref_gelu_tanh((x.astype(np.float32).reshape(m, n) + b.astype(np.float32)).ravel())
    np.testing.assert_allclose(o.astype(np.float64), ref, rtol=2e-3, atol=2e-3)


def test_softmax_rows_one_kernel(rng):
    rows, cols = 50, 128
    ck = compile_llvm(K.softmax_rows(rows, cols))
    x = (rng.standard_normal(rows * cols) * 10).astype(np.float32)
    o = np.empty_like(x)
    ck([x, o])
    np.testing.assert_allclose(o, K.ref_softmax(x, rows, cols), rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("form", ["all", "x", "y"])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_reduce_forms(form, op, rng):
    p, r = 19, 133  # not multiples of the lane count or tile width
    ck = compile_llvm(K.reduce_form(form, op, p, r))
    if op == "prod":
        x = rng.uniform(0.97, 1.03, p * r).astype(np.float32)
    else:
        x = rng.standard_normal(p * r).astype(np.float32)
    o = np.empty(ck.params[1].size, np.float32)
    ck([x, o])
    ref = K.ref_reduce(form, op, x, p, r)
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5 * (r if op == "sum" else 1))


def test_reduce_max_propagates_nan(rng):
    ck = compile_llvm(K.reduce_form("x", "max", 4, 40))
    x = rng.standard_normal(160).astype(np.float32)
    x[45] = np.nan
    o = np.empty(4, np.float32)
    ck([x, o])
    assert np.isnan(o[1]) and not np.isnan(o[[0, 2, 3]]).any()


def test_bias_maxpool(rng):
    ch, h, w = 3, 10, 14
    ck = compile_llvm(K.bias_maxpool(ch, h, w))
    x = rng.standard_normal(ch * h * w).astype(np.float32)
    b = rng.standard_normal(ch).astype(np.float32)
    o = np.empty(ch * (h // 2) * (w // 2), np.float32)
    ck([x, b, o])
    np.testing.assert_array_equal(o, K.ref_bias_maxpool(x, b, ch, h, w))


def test_int64_and_bool_kernel(rng):
    n = 1000
    ck = compile_llvm(K.int_kernel(n))
    a = rng.integers(0, 100, n).astype(np.int64)
    b = rng.integers(0, 100, n).astype(np.int64)
    a[::7] = -a[::7] - 1  # a few negatives: only in select/compare/abs, not in //, %
    m = rng.random(n) < 0.5
    pos = (a * 3 + b) >= 0
    m &= pos
    o, o32, ob = np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.bool_)
    ck([a, b, m, o, o32, ob])
    rv, r32, rb = K.ref_int_kernel(a, b, m)
    np.testing.assert_array_equal(o, rv)
    np.testing.assert_array_equal(o32, r32)
    np.testing.assert_array_equal(ob, rb)


def test_float64_math(rng):
    n = 2000
    ck = compile_llvm(K.float64_kernel(n))
    x = rng.standard_normal(n) * 5
    o = np.empty(6 * n)
    ck([x, o])
    np.testing.assert_allclose(o, K.ref_float64(x), rtol=1e-12, atol=1e-15)


def test_chunks_cover_only_their_range(rng):
    m, n = 10, 32
    ck = compile_llvm(K.bias_gelu(m, n))
    x = rng.standard_normal(m * n).astype(np.float32)
    b = np.zeros(n, np.float32)
    o = np.full(m * n, -7.0, np.float32)
    ck([x, b, o], lo=3, hi=5)
    rows = o.reshape(m, n)
    assert (rows[:3] == -7).all() and (rows[5:] == -7).all()
    np.testing.assert_allclose(rows[3:5].ravel(), K.ref_gelu_tanh(x.reshape(m, n)[3:5].ravel()),
                               rtol=2e-6, atol=1e-6)


def _vector_types(ir: str) -> set:
    return set(re.findall(r"<(\d+) x (float|double|i64|i32)>", ir))


def test_elementwise_ir_is_vectorised():
    ck = compile_llvm(K.bias_gelu(64, 256))
    widths = {int(w) for w, t in _vector_types(ck.ir) if t == "float"}
    assert widths & {8, 16}, ck.ir
    assert "@ap.tanhf" not in ck.ir and "call float @tanhf" not in ck.ir  # inlined, no libm


def test_reduce_ir_is_vectorised():
    for form in ("x", "y", "all"):
        ck = compile_llvm(K.reduce_form(form, "sum", 64, 256))
        widths = {int(w) for w, t in _vector_types(ck.ir) if t == "float"}
        assert widths & {8, 16}, (form, ck.ir)
    assert "reassoc" not in ck.ir


def test_unoptimised_ir_has_noalias_nsw_and_vector_hint():
    text = render_llvm(K.broadcast_add_mul(4, 64))
    assert "ptr noalias" in text and "mul nsw i64" in text
    assert "llvm.loop.vectorize.enable" in text
    assert "define void @bcast_add_mul(ptr %args, i64 %lo, i64 %hi)" in text


def test_bad_arrays_raise_input_error():
    ck = compile_llvm(K.bias_gelu(2, 8))
    x, b, o = np.zeros(16, np.float32), np.zeros(8, np.float32), np.zeros(16, np.float32)
    with pytest.raises(InputError, match="'b'"):
        ck([x, np.zeros(8, np.float64), o])
    with pytest.raises(InputError, match="'o'"):
        ck([x, b, np.zeros(4, np.float32)])
    with pytest.raises(InputError):
        ck([x, b])


def test_kernel_without_parallel_loop_ignores_lo_hi(rng):
    n = 50
    x, o = L.Param("x", "float32", n), L.Param("o", "float32", n)
    i = L.Var("i")
    k = L.Kernel("plain", (x, o), L.for_("i", 0, n, L.Store(o, i, x[i] * 2.0)))
    ck = compile_llvm(k)
    a = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(a)
    ck([a, out], lo=0, hi=0)
    np.testing.assert_array_equal(out, a * 2)


def test_asm_is_available_and_uses_host_vectors():
    ck = compile_llvm(K.broadcast_add_mul(8, 64))
    asm = ck.asm
    assert "bcast_add_mul" in asm
    assert re.search(r"%[yz]mm\d+", asm)


def test_concurrent_compiles_are_safe(rng):
    import threading
    results, errors = {}, []

    def job(n):
        try:
            results[n] = compile_llvm(K.bias_gelu(2, n))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
    threads = [threading.Thread(target=job, args=(16 * (k + 1),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for n, ck in results.items():
        x = rng.standard_normal(2 * n).astype(np.float32)
        o = np.empty_like(x)
        ck([x, np.zeros(n, np.float32), o])
        np.testing.assert_allclose(o, K.ref_gelu_tanh(x), rtol=2e-6, atol=1e-6)


def test_pack_args_rejects_non_arrays():
    ck = compile_llvm(K.bias_gelu(1, 4))
    with pytest.raises(InputError, match="'x'"):
        ck([[0.0] * 4, np.zeros(4, np.float32), np.zeros(4, np.float32)])


def test_int32_loop_variable(rng):
    n = 37
    x, o = L.Param("x", "float32", n), L.Param("o", "float32", n)
    i = L.Var("i", "int32")
    k = L.Kernel("i32loop", (x, o), L.For(i, 0, n, L.Store(o, i, x[i] + L.Cast("float32", i)),
                                          "vector"))
    a = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(a)
    compile_llvm(k)([a, out])
    np.testing.assert_array_equal(out, a + np.arange(n, dtype=np.float32))


def test_object_code_round_trip(rng):
    from apollo_py.codegen.llvm import emit_object, host_signature, load_object
    k = K.softmax_rows(6, 128)
    data = emit_object(k)
    assert isinstance(data, bytes) and len(data) > 100
    ck = load_object(k, data)
    x = rng.standard_normal(6 * 128).astype(np.float32)
    o = np.empty_like(x)
    ck([x, o])
    np.testing.assert_allclose(o, K.ref_softmax(x, 6, 128), rtol=2e-6, atol=1e-9)
    assert host_signature().count("/") >= 2


def test_object_code_with_libm_calls(rng):
    from apollo_py.codegen.llvm import emit_object, load_object
    k = K.float64_kernel(100)
    ck = load_object(k, emit_object(k))
    x = rng.standard_normal(100)
    o = np.empty(600)
    ck([x, o])
    np.testing.assert_allclose(o, K.ref_float64(x), rtol=1e-12, atol=1e-15)
