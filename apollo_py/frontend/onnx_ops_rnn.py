"""ONNX converters of the recurrent ops LSTM, GRU and RNN (opsets 7-22).

Each node becomes (see ``docs/design/small_models.md``):

1. the input projection of every time step and direction as one matmul,
   ``[T*B, I] @ [I, D*G*H]`` (W transposed; constant weights fold at compile time), plus the
   biases that can be added before the time loop (``Wb + Rb``; for GRU with
   ``linear_before_reset`` the h gate's ``Rbh`` stays out, since the reset gate multiplies it);
2. one ``recurrent`` primitive (ops/recurrent.py) over the projected inputs, which the CPU
   lowering turns into one generated kernel (codegen/recurrent.py);
3. transposes for ``layout = 1`` (batch-first) inputs and outputs.

Every attribute the ONNX spec defines is handled: ``direction`` (forward, reverse,
bidirectional), ``layout``, ``sequence_lens``, ``initial_h`` / ``initial_c``, LSTM peepholes
``P`` and ``input_forget``, ``clip``, GRU ``linear_before_reset``, ``hidden_size``, and the
``activations`` listed in :data:`apollo_py.ops.recurrent.ACTIVATIONS` with their
``activation_alpha`` / ``activation_beta`` (consumed in order by the activations that take them,
as onnxruntime does).  Anything else (another activation, a non-float dtype) raises
UnsupportedOpError naming the node, and the node runs through onnx.reference instead.
"""
from __future__ import annotations

import numpy as np

from ..ops.recurrent import ACTIVATIONS, GATES, rt_block
from .converters import converter

#: default activations per direction (ONNX spec)
_DEFAULT_ACTS = {"lstm": ("Sigmoid", "Tanh", "Tanh"), "gru": ("Sigmoid", "Tanh"), "rnn": ("Tanh",)}
_CANON = {k.lower(): k for k in ACTIVATIONS}


def _activations(cx, cell: str, nd: int) -> tuple:
    """Per direction, the (name, alpha, beta) triples of its activation functions."""
    nact = len(_DEFAULT_ACTS[cell])
    names = list(cx.attr("activations", []) or [])
    if not names:
        names = list(_DEFAULT_ACTS[cell]) * nd
    elif len(names) == nact and nd == 2:
        names = names * 2
    if len(names) != nact * nd:
        raise cx.error(f"activations lists {len(names)} functions; {cell.upper()} with {nd} direction(s) "
                       f"needs {nact * nd}")
    alphas = list(cx.attr("activation_alpha", []) or [])
    betas = list(cx.attr("activation_beta", []) or [])
    out = []
    for name in names:
        canon = _CANON.get(str(name).lower())
        if canon is None:
            raise cx.unsupported(f"activation {name!r} has no apollo_py lowering "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        da, db = ACTIVATIONS[canon]
        a = float(alphas.pop(0)) if da is not None and alphas else (da or 0.0)
        b = float(betas.pop(0)) if db is not None and betas else (db or 0.0)
        out.append((canon, a, b))
    return tuple(tuple(out[k * nact:(k + 1) * nact]) for k in range(nd))


@converter("LSTM", "GRU", "RNN")
def _recurrent(cx):
    b, node = cx.b, cx.node
    cell = node.op_type.lower()
    g = GATES[cell]
    x, w, r = cx.need(0), cx.need(1), cx.need(2)
    dtype = x.dtype
    if dtype not in ("float32", "float64"):
        raise cx.unsupported(f"dtype {dtype} (the recurrent kernel takes float32 and float64)")
    direction = cx.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise cx.error(f"direction {direction!r} is not forward, reverse or bidirectional")
    dirs = ("forward", "reverse") if direction == "bidirectional" else (direction,)
    nd = len(dirs)
    layout = int(cx.attr("layout", 0))
    if layout not in (0, 1):
        raise cx.error(f"layout {layout} is not 0 or 1")
    if len(x.shape) != 3 or len(w.shape) != 3 or len(r.shape) != 3:
        raise cx.error(f"X, W, R must have rank 3, got {x.shape}, {w.shape}, {r.shape}")
    if layout == 1:
        x = b.transpose(x, perm=(1, 0, 2))
    t_len, batch, isz = x.shape
    hsz = int(cx.attr("hidden_size", r.shape[-1]))
    if w.shape != (nd, g * hsz, isz) or r.shape != (nd, g * hsz, hsz):
        raise cx.error(f"W {w.shape} / R {r.shape} do not match {nd} direction(s), {g} gate(s), "
                       f"hidden_size {hsz}, input size {isz}")
    if w.dtype != dtype or r.dtype != dtype:
        raise cx.error(f"W and R must have X's dtype {dtype}")
    acts = _activations(cx, cell, nd)
    clip = cx.attr("clip", None)
    lbr = int(cx.attr("linear_before_reset", 0)) if cell == "gru" else 0
    input_forget = int(cx.attr("input_forget", 0)) if cell == "lstm" else 0
    gh = g * hsz

    # 1. input projection, all steps and directions in one product
    wt = b.reshape(b.transpose(w, perm=(2, 0, 1)), shape=(isz, nd * gh))
    xp = b.matmul(b.reshape(x, shape=(t_len * batch, isz)), wt)
    aux = None
    if cx.has(3):
        bias = cx.need(3)
        if bias.shape != (nd, 2 * gh):
            raise cx.error(f"B {bias.shape} is not {(nd, 2 * gh)}")
        wb = b.slice(bias, starts=(0, 0), ends=(nd, gh), steps=(1, 1))
        rb = b.slice(bias, starts=(0, gh), ends=(nd, 2 * gh), steps=(1, 1))
        if lbr:
            mask = np.ones((gh,), dtype)
            mask[2 * hsz:] = 0
            aux = b.slice(bias, starts=(0, gh + 2 * hsz), ends=(nd, 2 * gh), steps=(1, 1))
            rb = b.mul(rb, b.constant(mask))
        xp = b.add(xp, b.reshape(b.add(wb, rb), shape=(nd * gh,)))
    xp = b.reshape(xp, shape=(t_len, batch, nd * gh))

    # 2. the time loop
    def state(i, what):
        v = cx.x(i)
        if v is None:
            return b.constant(np.zeros((nd, batch, hsz), dtype))
        if layout == 1:
            v = b.transpose(v, perm=(1, 0, 2))
        if v.shape != (nd, batch, hsz) or v.dtype != dtype:
            raise cx.error(f"{what} {v.shape} {v.dtype} is not {(nd, batch, hsz)} {dtype}")
        return v

    if cx.has(4):
        lens = cx.need(4)
        if lens.shape != (batch,):
            raise cx.error(f"sequence_lens {lens.shape} is not ({batch},)")
        if lens.dtype != "int32":
            lens = b.op("cast", lens, to="int32")[0]
    else:
        lens = b.constant(np.full((batch,), t_len, np.int32))
    peephole = 0
    if cell == "lstm" and cx.has(7):
        aux = cx.need(7)
        if aux.shape != (nd, 3 * hsz) or aux.dtype != dtype:
            raise cx.error(f"P {aux.shape} is not {(nd, 3 * hsz)} {dtype}")
        peephole = 1
    if aux is None:
        aux = b.constant(np.zeros((nd, hsz if lbr else 1), dtype))
    # R^T in blocks of columns for the phased kernel's outer products (codegen/recurrent.py;
    # ops/recurrent.py, rt_block; a constant R folds at compile time); GRU without
    # linear_before_reset keeps the row-dot kernel over R as stored
    rt = rt_block(cell, hsz, dtype) if cell != "gru" or lbr else 0
    if rt:
        r = b.reshape(b.transpose(r, perm=(0, 2, 1)), shape=(nd, hsz, gh // rt, rt))
        r = b.transpose(r, perm=(0, 2, 1, 3))
    ins = [xp, r, state(5, "initial_h"), lens, aux]
    if cell == "lstm":
        ins.append(state(6, "initial_c"))
    outs = b.op("recurrent", *ins, cell=cell, hidden=hsz, directions=dirs, acts=acts,
                clip=-1.0 if clip is None else float(clip), lbr=lbr, input_forget=input_forget,
                peephole=peephole, rt=rt)

    # 3. outputs in the node's layout
    y, states = outs[0], list(outs[1:])
    if layout == 1:
        y = b.transpose(y, perm=(2, 0, 1, 3))
        states = [b.transpose(s, perm=(1, 0, 2)) for s in states]
    return [y, *states]
