"""Random primitive graphs for differential testing (issue #16 item 3): target "cpu" against
target "reference".  One integer seed makes one graph and its inputs, so a failing seed is a
regression test by itself.  Used by tests/test_differential.py (a few hundred seeds, drawn by
hypothesis) and tools/fuzz.py (``make fuzz``: 10,000 fixed seeds)."""
from __future__ import annotations

import numpy as np

import apollo_py as ap

DIMS = (0, 1, 1, 2, 3, 4, 5, 7, 8, 13, 16)    # 0 (empty), 1s (broadcast), small primes, powers of two
UNARY = ("exp", "tanh", "sigmoid", "relu", "neg", "abs", "sqrt", "log", "erf", "floor", "ceil", "reciprocal")
BINARY = ("add", "sub", "mul", "div", "max", "min")
REDUCE = ("reduce_sum", "reduce_max", "reduce_min")
#: graph dtypes and how often a seed draws each (from its own stream: a float32 seed makes the
#: graph it made before dtypes were added)
DTYPES = ("float32", "float64", "int32", "int64", "bool")
DTYPE_P = (0.5, 0.14, 0.12, 0.12, 0.12)
INT_UNARY = ("neg", "abs", "relu")
INT_BINARY = ("add", "sub", "mul", "div", "max", "min")
BOOL_BINARY = ("and", "or", "xor")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")


def graph_dtype(seed: int) -> str:
    return str(np.random.default_rng([seed, 7]).choice(DTYPES, p=DTYPE_P))


def _data(rng, shape, dtype):
    """Random values of ``dtype``: normal floats, small ints (so products and sums stay in
    range, and division meets negative numerators), fair bools."""
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("int"):
        return rng.integers(-6, 7, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _shape(rng, rank=None):
    rank = int(rng.integers(1, 4)) if rank is None else rank
    return tuple(int(rng.choice(DIMS)) for _ in range(rank))


def _safe_unary(b, op, x):
    """Unary op on a domain where float32 and float64 agree closely (no overflow, no pole)."""
    if x.type.dtype == "bool":
        return b.op("not", x)[0]
    if op == "exp":
        return b.exp(b.tanh(x))
    if op in ("sqrt", "log"):
        return getattr(b, op)(b.abs(x) + 0.5)
    if op == "reciprocal":
        return b.reciprocal(b.abs(x) + 1.0)
    if op in ("floor", "ceil"):
        return getattr(b, op)(x * 4.0 + 0.37)        # away from integers: rounding is exact
    return getattr(b, op)(x)


def _broadcast_partner(rng, shape):
    """A shape that broadcasts against ``shape`` (dims kept, set to 1, or leading dims dropped)."""
    out = [d if rng.random() < 0.6 else 1 for d in shape]
    drop = int(rng.integers(0, len(out))) if len(out) > 1 and rng.random() < 0.3 else 0
    return tuple(out[drop:])


def _binary(rng, b, x, other, dt):
    if dt == "bool":
        return b.op(str(rng.choice(BOOL_BINARY)), x, other)[0]
    op = str(rng.choice(BINARY if dt.startswith("float") else INT_BINARY))
    if op == "div":
        return x / (b.abs(other) + 1.0)    # ints: truncating division, negative numerators too
    return getattr(b, op)(x, other) if op not in ("add", "sub", "mul") else \
        {"add": x + other, "sub": x - other, "mul": x * other}[op]


def _typed_step(rng, b, x, other, dt):
    """A dtype-specific detour that comes back to ``dt``: a comparison feeding a select, or a
    cast round trip (float -> int32 -> float truncates; int -> float64 * 0.5 -> int truncates
    halves toward zero; bool -> int32 -> sum -> > 0)."""
    if rng.random() < 0.5:
        if dt == "bool":
            return b.op("where", b.op(str(rng.choice(("eq", "ne"))), x, other)[0], x, b.op("not", other)[0])[0]
        return b.op("where", b.op(str(rng.choice(COMPARE)), x, other)[0], x, other)[0]
    if dt == "bool":
        i = b.cast(x, to="int32")
        return b.op("gt", i + i, b.constant(np.zeros((), np.int32)))[0]
    # float -> int of a value out of the int's range (or NaN) is undefined (C, LLVM's fptosi,
    # ONNX Cast; numpy gives INT_MIN on x86): keep the values cast to ints in range (the
    # identities of empty reductions are the ints' and floats' extremes, +-inf)
    if dt.startswith("float"):
        v = x * 4.0 + 0.37
        v = b.op("where", b.op("lt", b.abs(v), b.constant(np.asarray(1e6, dt)))[0], v, b.constant(np.zeros((), dt)))[0]
        return b.cast(b.cast(v, to="int32"), to=dt)
    return b.cast(b.cast(x, to="float64") * 0.5, to=dt)


def random_graph(seed: int, max_ops: int = 8):
    """(graph, feeds) for ``seed``: a chain with side branches over elementwise, broadcast,
    reduction, transpose, slice, concat, comparison/select and cast ops, so every partition
    rule and stitch is reached, in one dtype per graph (:func:`graph_dtype`: float32, float64,
    int32, int64 or bool; each op drawn among those the dtype allows)."""
    rng = np.random.default_rng(seed)
    dt = graph_dtype(seed)
    b = ap.GraphBuilder(f"fuzz{seed}")
    base = _shape(rng)
    vals = [b.input("x0", base, dt) if dt != "float32" else b.input("x0", base)]
    if rng.random() < 0.6:
        vals.append(b.input("x1", _broadcast_partner(rng, base), dt) if dt != "float32"
                    else b.input("x1", _broadcast_partner(rng, base)))
    n = int(rng.integers(1, max_ops + 1))
    for _ in range(n):
        x = vals[int(rng.integers(0, len(vals)))] if rng.random() < 0.4 else vals[-1]
        kind = rng.choice(["unary", "binary", "binary", "reduce", "transpose", "slice", "concat"])
        rank = x.type.rank
        if kind == "unary":
            op = str(rng.choice(UNARY if dt.startswith("float") else INT_UNARY))
            y = _safe_unary(b, op, x) if dt.startswith("float") or dt == "bool" else getattr(b, op)(x)
        elif kind == "binary":
            others = [v for v in vals if _broadcasts(v.type.shape, x.type.shape)]
            other = others[int(rng.integers(0, len(others)))] if others and rng.random() < 0.7 else \
                b.constant(_data(rng, _broadcast_partner(rng, x.type.shape), dt))
            if dt != "float32" and rng.random() < 0.3:
                y = _typed_step(rng, b, x, other, dt)
            elif dt == "bool" and rng.random() < 0.3:
                y = b.op("xor", x, other)[0]
            else:
                y = _binary(rng, b, x, other, dt)
        elif kind == "reduce" and rank >= 1:
            k = int(rng.integers(1, rank + 1))
            axes = tuple(sorted(int(a) for a in rng.choice(rank, size=k, replace=False)))
            y = getattr(b, str(rng.choice(REDUCE)))(x, axes=axes, keepdims=bool(rng.random() < 0.5))
            if y.type.rank == 0:
                y = b.reshape(y, shape=(1,))
        elif kind == "transpose" and rank >= 2:
            y = b.transpose(x, perm=tuple(int(p) for p in rng.permutation(rank)))
        elif kind == "slice":
            starts, ends, steps = [], [], []
            for d in x.type.shape:
                s = int(rng.integers(0, d)) if d > 1 else 0
                e = int(rng.integers(s + 1, d + 1)) if d > 1 else d
                starts.append(s)
                ends.append(e)
                steps.append(1 if rng.random() < 0.8 else 2)
            y = b.slice(x, starts=tuple(starts), ends=tuple(ends), steps=tuple(steps))
        elif kind == "concat":
            axis = int(rng.integers(0, rank))
            other = (b.exp(b.neg(b.abs(x))) if dt.startswith("float") else b.op("not", x)[0] if dt == "bool"
                     else b.neg(x)) if rng.random() < 0.5 else x
            y = b.concat(x, other, axis=axis)
        else:
            y = b.op("not", x)[0] if dt == "bool" else b.relu(x)
        vals.append(y)
    outs = [vals[-1]]
    if len(vals) > 3 and rng.random() < 0.5:
        extra = vals[int(rng.integers(1, len(vals) - 1))]
        if extra.name not in {o.name for o in outs} and extra.name not in ("x0", "x1"):
            outs.append(extra)
    g = b.build(outs)
    feeds = {v: _data(rng, g.types[v].shape, dt) for v in g.inputs}
    return g, feeds


def _broadcasts(a, b) -> bool:
    """Whether ``a`` broadcasts onto ``b`` without changing ``b``'s shape."""
    if len(a) > len(b):
        return False
    return all(x == y or x == 1 for x, y in zip(a[::-1], b[::-1]))


def check_seed(seed: int, options: ap.Options | None = None) -> str | None:
    """None when cpu and reference agree on ``seed``'s graph, else a one-line description."""
    g, feeds = random_graph(seed)
    opts = options or ap.Options()
    want = ap.jit(g, options=opts.replace(target="reference")).run(**feeds)
    try:
        got = ap.jit(g, options=opts.replace(target="cpu")).run(**feeds)
    except ap.ApolloError as e:
        return f"seed {seed}: cpu raised {type(e).__name__}: {e}"
    if len(got) != len(want):
        return f"seed {seed}: {len(got)} outputs, reference has {len(want)}"
    for k, (a, w) in enumerate(zip(got, want)):
        if a.shape != w.shape or a.dtype != w.dtype:
            return f"seed {seed}: output {k} is {a.shape} {a.dtype}, reference {w.shape} {w.dtype}"
        if a.dtype.kind in "biu":
            if not np.array_equal(a, w):
                return f"seed {seed}: output {k} ({a.dtype}) differs at {int(np.sum(a != w))} of {a.size} elements"
        elif not np.allclose(a, w, rtol=1e-4, atol=1e-5, equal_nan=True):
            err = float(np.max(np.abs(a.astype(np.float64) - w)))
            return f"seed {seed}: output {k} differs, max abs error {err:.3g}"
    return None
