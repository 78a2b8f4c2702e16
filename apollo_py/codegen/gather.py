"""Loop-IR kernel of the ``gather`` primitive (ops/structural.py): ``np.take(data, idx, axis)``.

The data is viewed as ``[pre, n, post]`` (the dims before the axis, the axis, the dims after
it) and the output as ``[pre, m, post]`` with ``m`` the number of indices.  Per output row the
kernel reads one index, wraps a negative one (``+ n``, as numpy and ONNX do) and copies the
``post`` contiguous elements of that data row (a vector loop).

An index still outside ``[0, n)`` after the wrap is the caller's error, which a kernel cannot
raise: it stores 1 into its one-word ``err`` buffer and reads row 0 instead (so no load ever
leaves the data buffer).  The runtime checks the word after the call and raises the error the
numpy reference would have raised, naming the node (runtime/cpu.py).  This keeps a gather
inside a native driver segment (runtime/drive.py) instead of a Python step between segments.
"""
from __future__ import annotations

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError

#: data dtypes the kernel copies (the loop IR's buffer types that gathers meet in practice)
DATA_DTYPES = ("float32", "float64", "int32", "int64")


def gather_kernel(name: str, pre: int, n: int, m: int, post: int, dtype: str, idx_dtype: str) -> L.Kernel:
    """The Kernel ``out[p, i, q] = data[p, wrap(idx[i]), q]``; params ``data, idx, out, err``.

    The outermost loop of extent > 1 (``p``, else ``i``) is the parallel loop, so a large
    gather is split over the pool and a small one runs inline."""
    if dtype not in DATA_DTYPES:
        raise CompileError(f"gather kernel: data dtype {dtype} ({', '.join(DATA_DTYPES)} only)")
    if idx_dtype not in ("int32", "int64"):
        raise CompileError(f"gather kernel: index dtype {idx_dtype} (int32 / int64 only)")
    if min(pre, n, m, post) < 1:
        raise CompileError(f"gather kernel: empty extent (pre {pre}, n {n}, m {m}, post {post})")
    data = L.Param("data", dtype, pre * n * post)
    idx = L.Param("idx", idx_dtype, m)
    out = L.Param("out", dtype, pre * m * post)
    err = L.Param("err", "int64", 1)
    p, i, q = L.Var("p"), L.Var("i"), L.Var("q")
    raw = idx[i] if idx_dtype == "int64" else L.Cast("int64", idx[i])
    j = L.Local("j", "int64", raw)
    n_ = L.Const(n, "int64")
    wrap = L.If(L.lt(j.var, L.Const(0, "int64")), L.Assign("j", j.var + n_))
    bad = L.If(L.lor(L.lt(j.var, L.Const(0, "int64")), L.ge(j.var, n_)),
               L.block(L.Store(err, L.Const(0), L.Const(1, "int64")), L.Assign("j", L.Const(0, "int64"))))
    src = (p * n + j.var) * post if pre > 1 else j.var * post
    dst = (p * m + i) * post if pre > 1 else i * post
    if post > 1:
        copy = L.For(q, L.Const(0), L.Const(post), L.Store(out, dst + q, data[src + q]), "vector")
    else:
        copy = L.Store(out, dst, data[src])
    inner = L.For(i, L.Const(0), L.Const(m), L.block(j, wrap, bad, copy), "parallel" if pre == 1 else "serial")
    if pre > 1:
        k = L.Kernel(name, (data, idx, out, err), L.block(L.For(p, L.Const(0), L.Const(pre), inner, "parallel")),
                     "p", pre)
    else:
        k = L.Kernel(name, (data, idx, out, err), L.block(inner), "i", m)
    L.verify_kernel(k)
    return k
