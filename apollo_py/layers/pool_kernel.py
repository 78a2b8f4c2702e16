"""Direct pooling kernels for layer 1: max / average pooling with its elementwise neighbours.

A micro-graph ``elementwise prologue -> window_reduce -> elementwise epilogue`` (ResNet's
stem: ``add relu window_reduce``; average pooling: ``window_reduce mul``) went through the isl
scheduler as one loop nest that evaluated the prologue and a bounds test per window tap,
scalar: ResNet-50's stem max pool took 1.2-1.3 ms (6% of the memory roof).  Here, when the
window covers the trailing two dims of a float32 NCHW tensor (or the last dim of an NCL one, as
a one-row image):

* parallel over planes ``t = image * C + c``;
* per plane, the prologue is evaluated once per input element into a stack scratch holding the
  padded plane (padding = the reducer's identity, -inf or 0; rows outside the image are filled
  without evaluating anything);
* every output row is one ``vector`` loop over output columns whose body is the unrolled
  ``kh x kw`` max or sum of affine scratch loads (no per-element tests), then the epilogue chain
  and the stores.

:func:`pool_kernel` returns None for anything else (another reducer, dtype or window rank, a
prologue value needed outside, a plane over ``SCRATCH_BYTES``): the isl path runs it as before.
"""
from __future__ import annotations

from ..codegen import loopir as L

SCRATCH_BYTES = 256 * 1024     # one padded plane on the calling thread's stack
#: a window with a column stride ``sw > 1`` keeps the padded plane as ``sw`` column phases
#: (column ``c`` at phase ``c % sw``, position ``c // sw``), so that every tap's vector load over
#: output columns is unit-stride (docs/design/conv.md, "Pooling kernel")
PHASE_SPLIT = True


def _lift(shape: tuple, nsp: int) -> tuple:
    """``(N, C, H, W)`` of an ``nsp``-d pooled shape (a 1-d pool is an image of one row)."""
    return tuple(shape) if nsp == 2 else (*shape[:2], 1, shape[2])


def _match(nodes, types, outputs):
    """``(prologue, window node, epilogue)`` when ``nodes`` are that pattern, else None."""
    from .gemm_lowering import _fusable
    wrs = [k for k, n in enumerate(nodes) if n.op == "window_reduce"]
    if len(wrs) != 1:
        return None
    wr = nodes[wrs[0]]
    pre, post = list(nodes[:wrs[0]]), list(nodes[wrs[0] + 1:])
    xt, yt = types[wr.inputs[0]], types[wr.outputs[0]]
    nsp = len(wr.attrs["kernel"])
    if wr.attrs["reducer"] not in ("max", "sum") or xt.dtype != "float32" or yt.dtype != "float32" \
            or (xt.rank, nsp) not in ((4, 2), (3, 1)):
        return None
    known: set = set()
    for n in pre:
        if not _fusable(n, types, tuple(xt.shape), known) or n.outputs[0] in outputs:
            return None
        known.add(n.outputs[0])
    if pre and wr.inputs[0] not in known:
        return None
    made = set(known)
    known = {wr.outputs[0]}
    for n in post:
        if not _fusable(n, types, tuple(yt.shape), known) or set(n.inputs) & made:
            return None
        known.add(n.outputs[0])
    if not set(outputs) <= known:
        return None
    return pre, wr, post


def pool_kernel(nodes, types, inputs, outputs, consts, kname):
    """``(loop-IR kernel, params)`` of ``nodes`` as a direct pooling kernel, or None when they
    are not ``elementwise* -> window_reduce -> elementwise*`` on a float32 NCHW / NCL tensor
    (see the module docs).  ``consts`` are scalar constants inlined by layer 1; the kernel's
    params bind ``[v for v in inputs + outputs if v not in consts]`` in that order."""
    from ..codegen.gemm import EpiOperand, _operand_index
    from ..codegen.scalar_ops import scalar_op
    m = _match(nodes, types, outputs)
    if m is None:
        return None
    pre, wr, post = m
    a = wr.attrs
    nsp = len(a["kernel"])
    xs, ys = tuple(types[wr.inputs[0]].shape), tuple(types[wr.outputs[0]].shape)
    n, c, h, w = _lift(xs, nsp)
    oh, ow = _lift(ys, nsp)[2:]
    kh, kw = tuple(a["kernel"]) if nsp == 2 else (1, a["kernel"][0])
    sh, sw = (1, a["strides"][0]) if nsp == 1 else tuple(a["strides"])
    dh, dw = (1, a["dilations"][0]) if nsp == 1 else tuple(a["dilations"])
    ph, pw = (0, a["pads"][0]) if nsp == 1 else (a["pads"][0], a["pads"][1])
    prow, pcol = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    if min(n, c, h, w, oh, ow) <= 0 or prow * (pcol + sw - 1) * 4 > SCRATCH_BYTES:
        return None
    params = [v for v in list(inputs) + list(outputs) if v not in consts]
    if any(v not in types for v in params):
        return None
    from ..poly.ast_to_loopir import _ident
    # param names from the values (plans and tests read them), never a local's name
    taken = {"xpad", "t", "r", "cc", "oh", "ow", "acc", *(f"{p}{q}" for p in "xy" for q in range(len(nodes))),
             *(f"x{c}_{q}" for c in range(max(1, a["strides"][-1])) for q in range(len(nodes)))}
    bufs = {v: L.Param(_ident(v, taken), types[v].dtype, max(1, types[v].size)) for v in params}
    f32 = "float32"
    V = L.Var
    ident = L.Const(float("-inf") if a["reducer"] == "max" else 0.0, f32)
    cst = {v: L.Const(x, L.compute_dtype(types[v].dtype)) for v, x in consts.items()}

    def chain(chain_nodes, shape, row, col, start: dict, tag: str):
        """Evaluate ``chain_nodes`` at (row, col) of ``shape``: statements and the value env."""
        env = dict(cst)
        env.update(start)
        stmts = []
        made = {nd.outputs[0] for nd in chain_nodes}
        for v in dict.fromkeys(v for nd in chain_nodes for v in nd.inputs):
            if v not in env and v not in made:
                op = EpiOperand(v, types[v].dtype, tuple(types[v].shape))
                env[v] = L.Load(bufs[v], _operand_index(op, shape, 2, row, col))
        for q, nd in enumerate(chain_nodes):
            e = scalar_op(nd, [env[v] for v in nd.inputs], [], types[nd.outputs[0]].dtype)
            stmts.append(L.Local(f"{tag}{q}", e.dtype, e))
            env[nd.outputs[0]] = V(f"{tag}{q}", e.dtype)
        return stmts, env

    t = V("t")
    # column phases of the scratch: a strided window's taps read one phase at unit stride
    ps = sw if PHASE_SPLIT and sw > 1 else 1
    qc = -(-pcol // ps)                 # scratch columns per phase row
    plane = prow * qc
    pad = L.Alloc("xpad", f32, ps * plane)
    ih = V("r") - ph
    dst = V("r") * qc
    fills, lo_all, hi_all, ranges, vals = [], 0, None, [], []
    for pc in range(ps):
        # padded column cc * ps + pc; inside the image for lz <= cc < mid_hi
        iw = V("cc") * ps + (pc - pw)
        pro, penv = chain(pre, xs, t, ih * w + iw, {}, f"x{pc}_" if ps > 1 else "x")
        if pre:
            xval = penv[wr.inputs[0]]
        else:           # no prologue: the window input is a param, read directly
            xval = L.Load(bufs[wr.inputs[0]], _operand_index(EpiOperand(wr.inputs[0], f32, xs), xs, 2, t, ih * w + iw))
        ncols = -(-(pcol - pc) // ps)   # this phase's padded columns
        lz = min(max(0, -(-(pw - pc) // ps)), ncols)
        mid_hi = max(lz, min(-(-(pw + w - pc) // ps), ncols))
        row = dst + pc * plane + V("cc")
        fills.append(L.for_("cc", 0, ncols, L.Store(pad, row, ident), "vector"))
        vals.append(L.block(*pro, L.Store(pad, row, xval)))
        ranges.append((lz, mid_hi, ncols, row))
        lo_all, hi_all = max(lo_all, lz), mid_hi if hi_all is None else min(hi_all, mid_hi)
    hi_all = max(lo_all, hi_all)
    copies = []
    for pc, (lz, mid_hi, ncols, row) in enumerate(ranges):
        # the columns only this phase has in the image (at most a few at each edge); the
        # shared range below reads the input's consecutive columns for all phases at once
        copies += [L.for_("cc", 0, lz, L.Store(pad, row, ident), "vector"),
                   L.for_("cc", lz, min(lo_all, mid_hi), vals[pc]),
                   L.for_("cc", max(hi_all, lz), mid_hi, vals[pc]),
                   L.for_("cc", mid_hi, ncols, L.Store(pad, row, ident), "vector")]
    copies.append(L.for_("cc", lo_all, hi_all, L.block(*vals), "vector"))
    copy = L.for_("r", 0, prow, L.If(L.land(L.ge(ih, 0), L.lt(ih, h)), L.block(*copies), L.block(*fills)))
    taps = [L.Load(pad, ((j * dw) % ps) * plane + (V("oh") * sh + i * dh) * qc
                   + (V("ow") * (sw // ps) + (j * dw) // ps)) for i in range(kh) for j in range(kw)]
    acc = _tree(taps, L.maximum if a["reducer"] == "max" else (lambda p, q: p + q))
    epi, eenv = chain(post, ys, t, V("oh") * ow + V("ow"), {wr.outputs[0]: V("acc", f32)}, "y")
    lin = t * (oh * ow) + V("oh") * ow + V("ow")
    stores = [L.Store(bufs[v], lin, eenv[v]) for v in outputs]
    rows = L.for_("oh", 0, oh, L.for_("ow", 0, ow, L.block(L.Local("acc", f32, acc), *epi, *stores), "vector"))
    body = L.block(pad, L.for_("t", 0, n * c, L.block(copy, rows), "parallel"))
    return L.Kernel(kname, tuple(bufs[v] for v in params), body, "t", n * c), params


def _tree(terms: list, op, chains: int = 4) -> L.Expr:
    """``op``-reduction of ``terms`` as ``chains`` interleaved chains joined at the end (a single
    chain of 9-49 dependent max / add ops is latency-bound)."""
    parts: list = [None] * min(chains, len(terms))
    for q, term in enumerate(terms):
        k = q % len(parts)
        parts[k] = term if parts[k] is None else op(parts[k], term)
    while len(parts) > 1:
        parts = [op(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]

