"""GPU templates for the canonical reduce forms and layer-2 stitched row programs.

A layer-1 kernel whose reductions all share one canonical form (``FusedKernel.reduce_form``,
from poly/reduce_forms.py: x-reduce
``[P, R]``, y-reduce ``[R, P]``, all-reduce ``[R]``, not transposed) and whose other primitives
are elementwise / broadcast is rendered from its *nodes*, not from its CPU loop nest:

* **x-reduce and all-reduce**: one block of ``BS`` threads per row ``p`` (grid-stride over
  rows); the threads stride over the row (coalesced), each folds its elements into a register,
  then warp shuffles and a shared-memory step (``ap_block_reduce`` in the prelude) give every
  thread the row's result;
* **y-reduce**: a ``32 x BY`` block per 32 adjacent columns; ``threadIdx.y`` splits the reduced
  rows, the column partials are folded through shared memory (``ap_column_reduce``);
* **stitched** (layer 2, rules 7 and 8: softmax, log-softmax, layer norm): the reductions of a
  row run one after another in the same block; each result stays in a register of every thread
  (APOLLO's memory stitching: the reduced intermediate never goes to global memory), full-size
  intermediates are recomputed from their inputs where they are used (their inputs stay in L1 /
  L2) and only the kernel's outputs are stored.

Summation order: thread ``t`` folds elements ``t, t + BS, ...`` in order, lanes are combined by a
butterfly, warps in index order -- fixed by ``BS``, so results are reproducible run to run (not
bit-identical to the CPU target's order).  Returns None for kernels outside these forms; the
caller renders those with the generic mapping (codegen/cuda.py).
"""
from __future__ import annotations

from math import prod

from apollo_py.codegen import loopir as L
from apollo_py.codegen.cuda import (ARCHS, PRELUDE, Arch, CudaKernel, CudaPrinter, device_body, entry,
                                    param_decls)
from apollo_py.codegen.templates import combine, identity

REDUCERS = ("sum", "max", "min", "prod")
ALL, X, Y = "all", "x", "y"          # poly/reduce_forms.py's kinds (codegen sits below poly)
ACC_DTYPES = ("float32", "float64", "int32", "int64")
COLUMN_ROWS = 8        # BY of the y-reduce block (32 x 8 threads)


def _block_size(form: str, R: int) -> int:
    if form == ALL:
        return 1024
    want = max(32, 1 << max(0, (-(-R // 4) - 1).bit_length()))
    return min(512, want)


class _Reject(Exception):
    pass


def _strides(shape) -> list:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def _squeeze(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def render_reduce(fk, types, arch: Arch = ARCHS["sm_80"]) -> CudaKernel | None:
    """A reduce-form / stitched CUDA kernel for layer-1 kernel ``fk`` (a FusedKernel), or None.

    ``types`` maps value names to TensorTypes.  The kernel takes ``fk.loop``'s params in order
    (so it binds the same values as the generic rendering).
    """
    try:
        return _render(fk, types, arch)
    except _Reject:
        return None


def _render(fk, types, arch: Arch) -> CudaKernel:
    from apollo_py.ops.registry import get_op
    from apollo_py.codegen.scalar_ops import scalar_op
    nodes = [n for n in fk.nodes if n.op != "constant"]
    reds = [n for n in nodes if n.op.startswith("reduce_")]
    if not reds:
        raise _Reject
    F = tuple(types[reds[0].inputs[0]].shape)
    rank = len(F)
    axes = frozenset(int(a) % max(rank, 1) for a in reds[0].attrs["axes"])
    for n in reds:
        if n.op[7:] not in REDUCERS or tuple(types[n.inputs[0]].shape) != F or \
                frozenset(int(a) % max(rank, 1) for a in n.attrs["axes"]) != axes:
            raise _Reject
        if L.compute_dtype(types[n.outputs[0]].dtype) not in ACC_DTYPES:
            raise _Reject
    # layer 1 classified the kernel's last reduction (poly/reduce_forms.py); every reduction
    # here has the same input shape and axes, so that form is theirs
    form = fk.reduce_form
    if form is None or form.transposed or form.R <= 1 or form.kind not in (ALL, X, Y):
        raise _Reject
    P, R, kind = form.P, form.R, form.kind
    kept_shape = _squeeze(F[d] for d in form.kept)
    params = {v: prm for v, prm in zip(fk.param_values, fk.loop.params)}
    if len(params) != len(fk.loop.params):
        raise _Reject
    fstr = _strides(F)

    def full_index(v, flat: L.Expr) -> L.Expr:
        shape = tuple(types[v].shape)
        if len(shape) > rank:
            raise _Reject
        sh = (1,) * (rank - len(shape)) + shape
        if any(a not in (1, b) for a, b in zip(sh, F)):
            raise _Reject
        if sh == F:
            return flat
        # an operand spanning exactly the reduced (kept) dims is indexed by r (p): no int64
        # division per element (layer norm's gamma and beta)
        red, kept = set(form.reduced), set(form.kept)
        if all((sh[d] == F[d]) == (d in red) or F[d] == 1 for d in range(rank)):
            return L.Var("ap_r")
        if kind != ALL and all((sh[d] == F[d]) == (d in kept) or F[d] == 1 for d in range(rank)):
            return p_var
        vstr = _strides(sh)
        idx: L.Expr = L.Const(0)
        for d in range(rank):
            if sh[d] != 1:
                idx = idx + ((flat // fstr[d]) % F[d]) * vstr[d] if fstr[d] != 1 else idx + (flat % F[d]) * vstr[d]
        return idx

    def row_index(v, p: L.Expr) -> L.Expr:
        t = types[v]
        if t.size == 1:
            return L.Const(0)
        if t.size == P and _squeeze(t.shape) == kept_shape:
            return p
        raise _Reject

    def const_of(v):
        c = fk.consts.get(v)
        return None if c is None else L.Const(c, L.compute_dtype(types[v].dtype))

    p_var, flat_var = L.Var("ap_p"), L.Var("ap_flat")
    full: dict = {}       # value -> function(flat Expr) -> Expr
    row: dict = {}        # value -> Expr (register or constant)
    pr = CudaPrinter()
    pr.depth = 2
    lines_before = []
    acc_n = 0

    def operand(v, ctx: str):
        c = const_of(v)
        if c is not None:
            return lambda fl: c
        if v in row:
            e = row[v]
            return lambda fl: e
        if v in full:
            if ctx == "row":
                raise _Reject
            return full[v]
        if v not in params:
            raise _Reject
        prm = params[v]
        if ctx == "row":
            idx = row_index(v, p_var)
            return lambda fl: L.Load(prm, idx)
        return lambda fl: L.Load(prm, full_index(v, fl))

    def f16(v, e: L.Expr) -> L.Expr:
        return L.Un("round_f16", e) if types[v].dtype == "float16" else e

    if kind == Y:
        start, stride, guard = "(int64_t)threadIdx.y", COLUMN_ROWS, L.Var("ap_ok", "bool")
        block = (32, COLUMN_ROWS, 1)
        n_units = -(-P // 32)
    else:
        bs = _block_size(kind, R)
        start, stride, guard = "(int64_t)threadIdx.x", bs, None
        block = (bs, 1, 1)
        n_units = P
    flat_of = {X: p_var * R + L.Var("ap_r"), Y: L.Var("ap_r") * P + p_var, ALL: L.Var("ap_r")}[kind]

    def strided(stmts):
        pr.line(f"for (int64_t ap_r = {start}; ap_r < INT64_C({R}); ap_r += {stride}) {{")
        pr.depth += 1
        pr.stmt(L.Local("ap_flat", "int64", flat_of))
        body = L.block(*stmts)
        pr.stmt(L.If(guard, body) if guard is not None else body)
        pr.depth -= 1
        pr.line("}")

    for n in nodes:
        out = n.outputs[0]
        if n.op.startswith("reduce_"):
            op = n.op[7:]
            adt = L.compute_dtype(types[out].dtype)
            elem = operand(n.inputs[0], "full")(flat_var)
            if elem.dtype != adt:
                elem = L.Cast(adt, elem)
            name = f"ap_acc{acc_n}"
            acc_n += 1
            ident = identity(op, adt)
            pr.stmt(L.Local(name, adt, ident))
            strided([L.Assign(name, combine(op, L.Var(name, adt), elem))])
            ctype = pr.type_name(adt)
            if kind == Y:
                pr.line(f"{name} = ap_column_reduce<{COLUMN_ROWS}, {ctype}>({name}, ap_op_{op}());")
            else:
                pr.line(f"{name} = ap_block_reduce<{stride}, {ctype}>({name}, ap_op_{op}(), {pr.expr(ident)});")
            row[out] = f16(out, L.Var(name, adt))
            continue
        opdef = get_op(n.op)
        if opdef.scalar is None or opdef.scalar == "iota" or len(n.outputs) != 1:
            raise _Reject
        is_full = any(v in full or (v not in row and const_of(v) is None and types[v].size not in (1,)
                                     and not (types[v].size == P and _squeeze(types[v].shape) == kept_shape
                                              and types[out].size == types[v].size))
                      for v in n.inputs)
        odt = types[out].dtype
        if is_full:
            if _squeeze(types[out].shape) != _squeeze(F):
                raise _Reject
            ops = [operand(v, "full") for v in n.inputs]

            def make(n=n, ops=ops, out=out, odt=odt):
                return lambda fl: f16(out, scalar_op(n, [o(fl) for o in ops], [], L.compute_dtype(odt)))
            full[out] = make()
        else:
            if types[out].size not in (1, P):
                raise _Reject
            e = f16(out, scalar_op(n, [operand(v, "row")(None) for v in n.inputs], [], L.compute_dtype(odt)))
            name = f"ap_rv{acc_n}"
            acc_n += 1
            pr.stmt(L.Local(name, e.dtype, e))
            row[out] = L.Var(name, e.dtype)
    full_outs = [v for v in fk.outputs if v in full]
    row_outs = [v for v in fk.outputs if v in row]
    if len(full_outs) + len(row_outs) != len(fk.outputs):
        raise _Reject
    for v in full_outs:
        if types[v].size != P * R:
            raise _Reject
    if full_outs:
        strided([L.Store(params[v], flat_var, full[v](flat_var)) for v in full_outs])
    lead = L.eq(L.Var("ap_lead", "int64"), 0)
    if row_outs:
        stores = L.block(*[L.Store(params[v], row_index(v, p_var), row[v]) for v in row_outs])
        pr.stmt(L.If(L.land(guard, lead) if guard is not None else lead, stores))
    body = "\n".join(pr.lines)
    if kind == Y:
        head = ("    const int64_t ap_lead = threadIdx.y;\n"
                f"    for (int64_t ap_pb = ap_bid; ap_pb < INT64_C({n_units}); ap_pb += ap_nblk) {{\n"
                "        const int64_t ap_p = ap_pb * 32 + threadIdx.x;\n"
                f"        const bool ap_ok = ap_p < INT64_C({P});\n")
    else:
        head = ("    const int64_t ap_lead = threadIdx.x;\n"
                f"    for (int64_t ap_p = ap_bid; ap_p < INT64_C({n_units}); ap_p += ap_nblk) {{\n")
    text = head + body + "\n    }"
    k = fk.loop
    threads = block[0] * block[1]
    grid = (max(1, min(n_units, arch.sms * max(1, 2048 // threads))), 1, 1)
    src = PRELUDE + "\n" + device_body(k.name, k.params, text, pr) + entry(k.name, k.params, block, pr)
    esize = 8 if any(L.compute_dtype(types[n.outputs[0]].dtype) in ("float64", "int64") for n in reds) else 4
    shared = (COLUMN_ROWS * 33 * esize) if kind == Y else (block[0] // 32 * esize if block[0] > 32 else 0)
    label = {X: "x-reduce", Y: "y-reduce", ALL: "all-reduce"}[kind]
    if len(reds) > 1 or any(v in full for v in fk.outputs) or len(nodes) > len(reds) + 2:
        label = f"stitched {label}" if len(reds) > 1 else label
    ck = CudaKernel(k.name, src, param_decls(k.params), grid, block, label, shared_bytes=shared)
    ck.check(arch)
    return ck
