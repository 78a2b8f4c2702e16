"""Loop-IR kernel of the ``recurrent`` primitive (ops/recurrent.py): an LSTM/GRU/RNN time loop.

One kernel walks every time step of every direction; per step it computes the recurrent
products ``h_{t-1} @ R^T`` (per gate unit, the dot of R's contiguous row with the state of every
batch row of the block at once, in vector lanes) into a scratch ``gates`` array, then the gate
arithmetic of all units, then writes the new state.  The state lives in the ``Y_h`` / ``Y_c``
outputs (initialised from ``h0`` / ``c0``), so it stays in L1 for small hidden sizes and nothing
is allocated per call.

Parallel loop: ``p`` over (direction, block of ``bs`` batch rows); directions and batch rows are
independent through time, so chunks need no synchronisation.  Within a block, each vector of R
is loaded once per step and used from a register for every row of the block.

Expects float32 or float64 operands (the lowering keeps other dtypes on the numpy reference).
"""
from __future__ import annotations

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError
from apollo_py.ops.recurrent import ACTIVATIONS, GATES


def _act(name: str, alpha: float, beta: float, x: L.Expr) -> L.Expr:
    """ONNX activation ``name`` applied to ``x`` (loop-IR expression)."""
    dt = x.dtype

    def c(v):
        return L.Const(float(v), dt)
    if name == "Sigmoid":
        return L.Un("sigmoid", x)
    if name == "Tanh":
        return L.Un("tanh", x)
    if name == "Relu":
        return L.maximum(x, c(0))
    if name == "HardSigmoid":
        return L.minimum(L.maximum(c(alpha) * x + c(beta), c(0)), c(1))
    if name == "LeakyRelu":
        return L.Select(L.ge(x, c(0)), x, c(alpha) * x)
    if name == "Affine":
        return c(alpha) * x + c(beta)
    if name == "ScaledTanh":
        return c(alpha) * L.Un("tanh", c(beta) * x)
    if name == "Softsign":
        return x / (c(1) + L.Un("abs", x))
    if name == "Softplus":
        return L.Un("log", c(1) + L.Un("exp", x))
    raise CompileError(f"recurrent kernel: activation {name!r} has no loop-IR form "
                       f"(supported: {', '.join(ACTIVATIONS)})")


def _direction_act(acts, nd: int, d, k: int, x: L.Expr) -> L.Expr:
    """Activation ``k`` (f, g, h) of direction ``d`` (an index expression) over ``nd``
    directions with activations ``acts``: a Select chain where directions differ."""
    outs = [_act(*acts[di][k], x) for di in range(nd)]
    e = outs[-1]
    for di in range(nd - 2, -1, -1):
        if outs[di] != e:
            e = L.Select(L.eq(d, di), outs[di], e)
    return e


def _lstm_cell(attrs, gv, cprev, peep, act, clipped, cf, dtype):
    """The LSTM cell of one unit (both kernels): gate pre-activations ``gv`` = (i, o, f, c), the
    previous cell state ``cprev``, ``peep(k)`` the peephole weight of gate k (0 = i, 1 = o,
    2 = f).  Returns ``(statements setting the locals i_g and c_new, c_new, the new h)``."""
    zi, zo, zf, zc = gv
    if attrs["peephole"]:
        zi = zi + peep(0) * cprev
        zf = zf + peep(2) * cprev
    i_g = L.Var("i_g", dtype)
    f_g = cf(1) - i_g if attrs["input_forget"] else act(0, clipped(zf))
    c_new = L.Var("c_new", dtype)
    zo_full = zo + peep(1) * c_new if attrs["peephole"] else zo
    cell = [L.Local("i_g", dtype, act(0, clipped(zi))),
            L.Local("c_new", dtype, f_g * cprev + i_g * act(1, clipped(zc)))]
    return cell, c_new, act(0, clipped(zo_full)) * act(2, c_new)


def _params(dtype: str, t_len: int, batch: int, nd: int, gh: int, hsz: int, aux_len: int,
            lstm: bool) -> dict:
    """The kernels' parameters by name, in ABI order: ``xp, r, h0, lens, aux, [c0], y, yh,
    [yc]`` (``r`` is R^T: [D, H, G*H]; ``c0`` / ``yc`` only for an LSTM)."""
    state = nd * batch * hsz
    out = {"xp": L.Param("xp", dtype, t_len * batch * nd * gh), "r": L.Param("r", dtype, nd * gh * hsz),
           "h0": L.Param("h0", dtype, state), "lens": L.Param("lens", "int32", batch),
           "aux": L.Param("aux", dtype, nd * aux_len)}
    if lstm:
        out["c0"] = L.Param("c0", dtype, state)
    out["y"] = L.Param("y", dtype, t_len * state)
    out["yh"] = L.Param("yh", dtype, state)
    if lstm:
        out["yc"] = L.Param("yc", dtype, state)
    return out


def block_rows(batch: int, directions: int, threads: int) -> int:
    """Batch rows per parallel chunk: the batch split evenly over the threads the directions
    leave idle, at most 4 rows (each R element loaded is reused from a register for the
    block's rows; 4 rows x 2 vector accumulators stay within 16 registers)."""
    per_dir = max(1, -(-threads // directions))
    return max(1, min(4, -(-batch // per_dir)))


def recurrent_kernel(name: str, attrs, t_len: int, batch: int, aux_len: int, dtype: str,
                     threads: int = 2) -> L.Kernel:
    """The loop-IR Kernel computing ``recurrent`` with attributes ``attrs`` for ``T = t_len``,
    ``B = batch``, ``aux`` of ``aux_len`` columns and float ``dtype``.  Params, in order:
    ``xp, r, h0, lens, aux, [c0], y, yh, [yc]`` (the op's inputs, then its outputs)."""
    if dtype not in ("float32", "float64"):
        raise CompileError(f"recurrent kernel: dtype {dtype} (float32 / float64 only)")
    cell, hsz = attrs["cell"], int(attrs["hidden"])
    g, nd = GATES[cell], len(attrs["directions"])
    gh = g * hsz
    lstm = cell == "lstm"
    clip = float(attrs["clip"])
    bs = block_rows(batch, nd, threads)
    nblk = -(-batch // bs)

    params = _params(dtype, t_len, batch, nd, gh, hsz, aux_len, lstm)
    xp, r, h0, lens, aux, c0, y, yh, yc = (params.get(n) for n in
                                            ("xp", "r", "h0", "lens", "aux", "c0", "y", "yh", "yc"))

    p, bi, j, s, tt = (L.Var(n) for n in ("p", "bi", "j", "s", "tt"))
    d, blk = L.Var("d"), L.Var("blk")
    b, n_b, t_b = L.Var("b"), L.Var("n_b"), L.Var("t_b")
    live = L.Var("live", "bool")
    gates = L.Alloc("gates", dtype, bs * gh)
    hn = L.Alloc("hn", dtype, bs * hsz)
    rh = L.Alloc("rh", dtype, bs * hsz)       # GRU without linear_before_reset: r * h_{t-1}

    def cf(v):
        return L.Const(float(v), dtype)

    def clipped(v):
        return L.minimum(L.maximum(v, cf(-clip)), cf(clip)) if clip >= 0 else v

    def row_prelude():
        """Locals b (batch row), n_b (its clamped length), t_b (this step's time index)."""
        n = L.Cast("int64", L.Load(lens, b))
        rev = [di for di, dname in enumerate(attrs["directions"]) if dname == "reverse"]
        if not rev:
            t_expr = s
        elif len(rev) == nd:
            t_expr = n_b - 1 - s
        else:
            t_expr = L.Select(L.eq(d, rev[0]), n_b - 1 - s, s)
        return [L.Local("n_b", "int64", L.minimum(L.maximum(n, 0), t_len)),
                L.Local("t_b", "int64", t_expr)]

    def per_row(body):
        """``body`` for each valid row of the block that is still running at step s."""
        return L.for_("bi", 0, bs, [
            L.Local("b", "int64", blk * bs + bi),
            L.If(L.lt(b, batch), [*row_prelude(), L.If(L.lt(s, n_b), list(body))]),
        ])

    def hidx(jj):  # element jj of row b's state in direction d
        return (d * batch + b) * hsz + jj

    # lanes per row: 2 x 16 float32 accumulators (two AVX-512 / four AVX2 registers) for long
    # rows; with bs rows at once that is 2*bs independent FMA chains sharing each load of R
    lanes = (32 if hsz >= 64 else 8) if dtype == "float32" else (16 if hsz >= 32 else 4)
    full = hsz // lanes
    dacc = L.Alloc("dacc", dtype, bs * lanes)
    q, c_, l_, kt = L.Var("q"), L.Var("c"), L.Var("l"), L.Var("kt")

    def src_row(src, bi_):
        """Start of row bi_'s state in ``src`` (yh: rows past the batch read the last row,
        whose results are never stored; rh: the scratch row)."""
        if src is yh:
            return (d * batch + L.minimum(blk * bs + bi_, L.Const(batch - 1))) * hsz
        return bi_ * hsz

    def dots(row_lo: int, row_hi: int, src):
        """gates[bi, j] = src row bi . r[d, j, :] for j in [row_lo, row_hi), every row of the block
        at once (each R element loaded once for the block)."""
        rrow = (d * gh + j) * hsz
        body = [L.for_("q", 0, bs * lanes, L.Store(dacc, q, cf(0)), "unroll")]
        if full:
            body.append(L.for_("c", 0, full, [L.for_("bi", 0, bs, [L.for_("l", 0, lanes, L.Store(
                dacc, bi * lanes + l_, dacc[bi * lanes + l_]
                + L.Load(src, src_row(src, bi) + c_ * lanes + l_) * r[rrow + c_ * lanes + l_]), "vector")],
                "unroll")]))
        if hsz % lanes:
            body.append(L.for_("kt", full * lanes, hsz, [L.for_("bi", 0, bs, L.Store(
                dacc, bi * lanes + kt - full * lanes, dacc[bi * lanes + kt - full * lanes]
                + L.Load(src, src_row(src, bi) + kt) * r[rrow + kt]), "unroll")]))
        # the lanes of each row folded as a tree (halves added, log2(lanes) vector adds): a serial
        # chain of lanes - 1 dependent scalar adds per (row, unit) took most of the step (no
        # reassoc flag lets LLVM reorder it)
        w = lanes
        while w > 1 and w % 2 == 0:
            w //= 2
            body.append(L.for_("bi", 0, bs, [L.for_("l", 0, w, L.Store(
                dacc, bi * lanes + l_, dacc[bi * lanes + l_] + dacc[bi * lanes + w + l_]), "vector")], "unroll"))
        fold = L.Var("fold", dtype)
        body.append(L.for_("bi", 0, bs, [
            L.Local("fold", dtype, dacc[bi * lanes]),
            L.for_("l", 1, w, L.Assign("fold", fold + dacc[bi * lanes + l_]), "unroll"),
            L.Store(gates, bi * gh + j, fold)], "unroll"))
        return L.for_("j", row_lo, row_hi, body)

    # the step: recurrent products, then gate math into hn (and yc), then hn -> yh and y
    acts = attrs["acts"]

    def act(k, x):
        return _direction_act(acts, nd, d, k, x)

    def xv(gi):  # projected input of gate gi, unit j, at this row's time index
        return xp[((t_b * batch + b) * nd + d) * gh + gi * hsz + j]

    dot = [gates[bi * gh + gi * hsz + j] for gi in range(g)]
    gv = [xv(gi) + dot[gi] for gi in range(g)]
    hprev = yh[hidx(j)]
    step: list = []
    if cell == "rnn":
        step.append(dots(0, gh, yh))
        elem = [L.Store(hn, bi * hsz + j, act(0, clipped(gv[0])))]
    elif lstm:
        step.append(dots(0, gh, yh))
        cell, c_new, h = _lstm_cell(attrs, gv, yc[hidx(j)], lambda k: aux[d * aux_len + k * hsz + j],
                                    act, clipped, cf, dtype)
        elem = [*cell, L.Store(yc, hidx(j), c_new), L.Store(hn, bi * hsz + j, h)]
    else:
        zt = act(0, clipped(gv[0]))
        if attrs["lbr"]:
            # linear_before_reset: the reset gate multiplies h @ Rh^T + Rbh
            step.append(dots(0, gh, yh))
            h_t = act(1, clipped(xv(2) + act(0, clipped(gv[1])) * (dot[2] + aux[d * aux_len + j])))
        else:
            # z and r first; r * h_{t-1} into rh; then the h gate's products read rh
            step += [dots(0, 2 * hsz, yh),
                     per_row([L.for_("j", 0, hsz, L.Store(rh, bi * hsz + j, act(0, clipped(gv[1])) * hprev),
                                     "vector")]),
                     dots(2 * hsz, gh, rh)]
            h_t = act(1, clipped(gv[2]))
        elem = [L.Store(hn, bi * hsz + j, (cf(1) - zt) * h_t + zt * hprev)]
    step.append(per_row([L.for_("j", 0, hsz, elem, "vector")]))
    step.append(per_row([L.for_("j", 0, hsz, [L.Store(yh, hidx(j), hn[bi * hsz + j]),
                                               L.Store(y, ((t_b * nd + d) * batch + b) * hsz + j,
                                                       hn[bi * hsz + j])], "vector")]))

    # per block: state from h0/c0, Y zeroed (rows past their length stay 0), then the time loop
    init = [L.for_("bi", 0, bs, [
        L.Local("b", "int64", blk * bs + bi),
        L.If(L.lt(b, batch), [
            # a row of length 0 reports a zero state, as onnxruntime does (ONNX leaves it open)
            L.Local("live", "bool", L.gt(L.Load(lens, b), L.Const(0, "int32"))),
            L.for_("j", 0, hsz, [L.Store(yh, hidx(j), L.Select(live, h0[hidx(j)], cf(0)))]
                   + ([L.Store(yc, hidx(j), L.Select(live, c0[hidx(j)], cf(0)))] if lstm else []), "vector"),
            L.for_("tt", 0, t_len, [L.for_("j", 0, hsz, L.Store(y, ((tt * nd + d) * batch + b) * hsz + j,
                                                                 cf(0)), "vector")]),
        ])])]
    body = L.for_("p", 0, nd * nblk, [
        L.Local("d", "int64", p // nblk), L.Local("blk", "int64", p % nblk),
        gates, hn, dacc, *([rh] if cell == "gru" and not attrs["lbr"] else []),
        *init, L.for_("s", 0, t_len, step)], "parallel")
    k = L.Kernel(name, tuple(params.values()), L.block(body), "p", nd * nblk)
    L.verify_kernel(k)
    return k


def phased(attrs) -> bool:
    """Whether :func:`recurrent_phased_kernel` covers ``attrs``: every cell except GRU without
    ``linear_before_reset`` (its h gate's products read ``r * h_{t-1}`` of every unit, which
    would need a second barrier per step)."""
    return attrs["cell"] != "gru" or bool(attrs["lbr"])


def unit_chunks(hidden: int, directions: int, threads: int, multiple: int = 1) -> int:
    """Chunks of hidden units per direction and phase: the threads the directions leave idle
    (one chunk each, so that each thread keeps streaming the same rows of R from its L2), or
    fewer, so that every chunk has the same number of units, a multiple of ``multiple``."""
    n = max(1, min(hidden, -(-threads // directions)))
    while hidden % n or (hidden // n) % multiple:
        n -= 1
    return n


def recurrent_phased_kernel(name: str, attrs, t_len: int, batch: int, aux_len: int, dtype: str,
                            threads: int = 2, rblock: int = 0) -> tuple[L.Kernel, int]:
    """The time loop cut into phases of chunks, for several threads on one recurrence.

    Returns ``(kernel, chunks)``: the kernel's parallel loop ``p`` runs over
    ``(T + 1) * chunks`` iterations, phase ``p // chunks`` and chunk ``p % chunks`` =
    (direction, block of hidden units).  Phase 0 initialises the chunk's units (``Y_h`` /
    ``Y_c`` from ``h0`` / ``c0``, ``Y`` zeroed); phase ``s + 1`` computes time step ``s`` of the
    chunk's units for every batch row: their rows of R dotted with ``h_{t-1}`` (read from ``Y``
    at the row's previous time index, or ``h0`` at step 0, never from ``Y_h``, which the
    other chunks of the step are writing), then the gate arithmetic into ``Y_h``, ``Y_c`` and
    ``Y[t]``.  A phase reads what the earlier phases wrote, so the chunks of one phase may run
    at once but phases must run in order: one call over the whole range is the sequential
    time loop, and ``codegen/phased.py`` runs it on several threads with a barrier between
    phases.  Each thread then streams only its units' rows of R (half of R on two threads,
    which fits the core's L2 where the whole of R does not).

    Same params as :func:`recurrent_kernel`; expects a cell :func:`phased` accepts."""
    if dtype not in ("float32", "float64"):
        raise CompileError(f"recurrent kernel: dtype {dtype} (float32 / float64 only)")
    if not phased(attrs):
        raise CompileError("recurrent phased kernel: GRU without linear_before_reset is not phased")
    cell, hsz = attrs["cell"], int(attrs["hidden"])
    g, nd = GATES[cell], len(attrs["directions"])
    gh = g * hsz
    lstm = cell == "lstm"
    clip = float(attrs["clip"])
    bs = min(4, batch)
    nblk = -(-batch // bs)
    wb = rblock or gh       # R^T's column block (ops/recurrent.py, rt_block)
    if wb != gh and (hsz % wb or wb > 8 * (16 if dtype == "float32" else 8)):
        raise CompileError(f"recurrent phased kernel: R^T block {wb} must divide hidden {hsz} "
                           f"(and hold at most 8 vectors)")
    uch = unit_chunks(hsz, nd, threads, 1 if wb == gh else wb)
    usz = hsz // uch
    nch = nd * uch

    params = _params(dtype, t_len, batch, nd, gh, hsz, aux_len, lstm)
    xp, r, h0, lens, aux, c0, y, yh, yc = (params.get(n) for n in
                                            ("xp", "r", "h0", "lens", "aux", "c0", "y", "yh", "yc"))

    p, bi, j, s, tt, q = (L.Var(n) for n in ("p", "bi", "j", "s", "tt", "q"))
    d, blk, ph = L.Var("d"), L.Var("blk"), L.Var("ph")
    u0, u1 = L.Var("u0"), L.Var("u1")
    b, n_b, t_b = L.Var("b"), L.Var("n_b"), L.Var("t_b")
    live = L.Var("live", "bool")
    gates = L.Alloc("gates", dtype, bs * g * usz)
    # units per outer-product block: 4 vector registers a row, bs rows: 16 accumulators
    lanes = 16 if dtype == "float32" else 8
    uw = max(1, min(4 * lanes, usz)) if wb == gh else wb
    acc = L.Alloc("acc", dtype, bs * uw)
    j0 = L.Var("j0")
    rev = [di for di, dname in enumerate(attrs["directions"]) if dname == "reverse"]

    def cf(v):
        return L.Const(float(v), dtype)

    def clipped(v):
        return L.minimum(L.maximum(v, cf(-clip)), cf(clip)) if clip >= 0 else v

    def length(row):
        return L.minimum(L.maximum(L.Cast("int64", L.Load(lens, row)), 0), t_len)

    def time_index(n):
        """This step's time index of a row of length n (reverse: n - 1 - s)."""
        if not rev:
            return s
        if len(rev) == nd:
            return n - 1 - s
        return L.Select(L.eq(d, rev[0]), n - 1 - s, s)

    def prev_index(n):
        """The time index of the row's h_{t-1} in Y (s >= 1), clamped into [0, T) for rows
        that are past their length (their results are never stored)."""
        if not rev:
            t = s - 1
        elif len(rev) == nd:
            t = n - s
        else:
            t = L.Select(L.eq(d, rev[0]), n - s, s - 1)
        return L.minimum(L.maximum(t, 0), t_len - 1)

    l_ = L.Var("l")
    offs = [L.Var(f"o{k}") for k in range(bs)]

    def row_offsets(first: bool) -> list:
        """Locals o0.. : start of each block row's h_{t-1} in h0 (step 0) or Y.  Rows past the
        batch read the last row (never stored)."""
        out = []
        for k in range(bs):
            row = L.minimum(blk * bs + k, L.Const(batch - 1))
            if first:
                out.append(L.Local(f"o{k}", "int64", (d * batch + row) * hsz))
            else:
                out.append(L.Local(f"o{k}", "int64", ((prev_index(length(row)) * nd + d) * batch + row) * hsz))
        return out

    iv = L.Var("i")

    def dots(src) -> L.Stmt:
        """gates[k, gi, j - u0] = sum_i h_{t-1}[row k, i] * rT[d, i, gi * H + j] for the chunk's
        units j, every gate gi and every row k of the block: outer products over blocks of
        ``uw`` units (the row's h element broadcast, ``uw`` contiguous units of R^T's row i), so
        bs x uw / lanes vector accumulators stay in registers and no lane is folded.  The last
        block of a chunk starts ``uw`` units before the chunk's end (it recomputes units of the
        block before it, the same values): no block reads past the chunk's units."""
        stmts = []
        for gi in range(g):
            body = [L.for_("q", 0, bs * uw, L.Store(acc, L.Var("q"), cf(0)), "unroll")]
            # R^T's row i through a local: the printer's row prefetch (codegen/llvm.py
            # prefetch_plan) would fetch all of a 4 KiB row per i for the uw units read of it
            rrow = L.Var("rrow")
            if wb == gh:
                rstart = (d * hsz + iv) * gh + gi * hsz + j0
            else:       # blocks of wb columns, each [H, wb]: j0 is a multiple of wb
                rstart = ((d * (gh // wb) + (j0 + gi * hsz) // wb) * hsz + iv) * wb
            body.append(L.for_("i", 0, hsz, [L.Local("rrow", "int64", rstart)] + [
                L.for_("l", 0, uw, L.Store(
                    acc, k * uw + l_, acc[k * uw + l_] + L.Load(src, offs[k] + iv) * r[rrow + l_]), "vector")
                for k in range(bs)]))
            body += [L.for_("l", 0, uw, L.Store(gates, (k * g + gi) * usz + j0 - u0 + l_, acc[k * uw + l_]),
                            "vector") for k in range(bs)]
            stmts.append(L.for_("jq", 0, -(-usz // uw), [
                L.Local("j0", "int64", u0 + L.minimum(L.Var("jq") * uw, usz - uw)), *body]))
        return L.block(*stmts)

    acts = attrs["acts"]

    def act(k, x):
        return _direction_act(acts, nd, d, k, x)

    def hidx(jj):
        return (d * batch + b) * hsz + jj

    def xv(gi):
        return xp[((t_b * batch + b) * nd + d) * gh + gi * hsz + j]

    dot = [gates[(bi * g + gi) * usz + j - u0] for gi in range(g)]
    gv = [xv(gi) + dot[gi] for gi in range(g)]
    hprev = yh[hidx(j)]     # this chunk's units of Y_h: written only by this unit's chunk
    h_new = L.Var("h_new", dtype)
    if cell == "rnn":
        elem = [L.Local("h_new", dtype, act(0, clipped(gv[0])))]
    elif lstm:
        cell, c_new, h = _lstm_cell(attrs, gv, yc[hidx(j)], lambda k: aux[d * aux_len + k * hsz + j],
                                    act, clipped, cf, dtype)
        elem = [*cell, L.Store(yc, hidx(j), c_new), L.Local("h_new", dtype, h)]
    else:   # GRU, linear_before_reset
        zt = act(0, clipped(gv[0]))
        h_t = act(1, clipped(xv(2) + act(0, clipped(gv[1])) * (dot[2] + aux[d * aux_len + j])))
        elem = [L.Local("h_new", dtype, (cf(1) - zt) * h_t + zt * hprev)]
    elem += [L.Store(yh, hidx(j), h_new), L.Store(y, ((t_b * nd + d) * batch + b) * hsz + j, h_new)]
    rows = L.for_("bi", 0, bs, [
        L.Local("b", "int64", blk * bs + bi),
        L.If(L.lt(b, batch), [L.Local("n_b", "int64", length(b)), L.If(L.lt(s, n_b), [
            L.Local("t_b", "int64", time_index(n_b)), L.for_("j", u0, u1, elem, "vector")])])])
    step = L.for_("blk", 0, nblk, [
        L.If(L.eq(s, 0), [*row_offsets(True), dots(h0)], [*row_offsets(False), dots(y)]),
        rows])

    init = L.for_("b", 0, batch, [
        # a row of length 0 reports a zero state, as onnxruntime does (ONNX leaves it open)
        L.Local("live", "bool", L.gt(L.Load(lens, b), L.Const(0, "int32"))),
        L.for_("j", u0, u1, [L.Store(yh, hidx(j), L.Select(live, h0[hidx(j)], cf(0)))]
               + ([L.Store(yc, hidx(j), L.Select(live, c0[hidx(j)], cf(0)))] if lstm else []), "vector"),
        L.for_("tt", 0, t_len, [L.for_("j", u0, u1, L.Store(y, ((tt * nd + d) * batch + b) * hsz + j,
                                                             cf(0)), "vector")])])
    body = L.for_("p", 0, (t_len + 1) * nch, [
        L.Local("ph", "int64", p // nch), L.Local("d", "int64", (p % nch) // uch),
        L.Local("u0", "int64", (p % uch) * usz), L.Local("u1", "int64", (p % uch) * usz + usz),
        gates, acc,
        L.If(L.eq(ph, 0), [init], [L.Local("s", "int64", ph - 1), step])], "parallel")
    k = L.Kernel(name, tuple(params.values()), L.block(body), "p", (t_len + 1) * nch)
    L.verify_kernel(k)
    return k, nch
