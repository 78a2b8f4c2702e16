"""Graph outputs the cpu runtime allocates start on a 64-byte boundary and are recycled only
when the caller holds neither them nor a view of them."""
import numpy as np

import apollo_py as ap
from apollo_py.runtime.memory import ALIGN, aligned_empty


def test_aligned_empty_shapes_and_dtypes():
    for shape, dtype in [((3, 5), np.float32), ((), np.float64), ((0, 7), np.int8),
                         ((17,), np.bool_), ((2, 3, 4), np.float16)]:
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % ALIGN == 0   # numpy moves empty arrays


def _softmax_fn():
    b = ap.GraphBuilder("sm")
    x = b.input("x", (64, 128))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    return ap.jit(b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)]), target="cpu")


def test_outputs_aligned_and_recycled_unless_a_view_is_held():
    f = _softmax_fn()
    xv = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    e = np.exp(xv - xv.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    first = f(xv)
    assert first.ctypes.data % ALIGN == 0
    np.testing.assert_allclose(first, want, rtol=2e-6, atol=1e-9)
    addr = first.ctypes.data
    del first
    second = f(xv)
    assert second.ctypes.data == addr          # dropped: recycled
    view = second[3:, :]
    del second                                 # only a view is held: must not be overwritten
    kept = view.copy()
    third = f(xv * 2.0)
    assert not np.shares_memory(view, third)
    np.testing.assert_array_equal(view, kept)
    assert third.ctypes.data % ALIGN == 0


def _holders():
    """Ways a caller keeps an output's memory without keeping the array variable: each holds a
    Python reference (directly or through its base), which the recycler's count sees."""
    import ctypes
    return {
        "memoryview": memoryview,
        "dlpack": np.from_dlpack,
        "frombuffer": lambda a: np.frombuffer(a, dtype=np.uint8),
        "ctypes_pointer": lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        "array_interface_object": lambda a: np.asarray(type("H", (), {"__array_interface__": a.__array_interface__,
                                                                       "keep": a})()),
    }


def test_output_held_through_buffer_dlpack_or_ctypes_is_not_recycled():
    import ctypes
    f = _softmax_fn()
    xv = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    for name, hold in _holders().items():
        first = f(xv)
        want = first.copy()
        addr = first.ctypes.data
        holder = hold(first)
        del first
        second = f(xv * 2.0)
        assert second.ctypes.data != addr, name
        read = np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(ctypes.c_float)), (64, 128))
        np.testing.assert_array_equal(read, want, err_msg=name)
        del holder, second
