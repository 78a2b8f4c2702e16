"""The ``recurrent`` primitive: the time loop of an ONNX LSTM, GRU or RNN node.

The ONNX front end (``frontend/onnx_ops_rnn.py``) splits a recurrent node in two: the input
projection ``X @ W^T + bias`` of every time step and direction as one matmul, and this op, which
walks time carrying the state.  Inputs, for ``D`` directions, ``G`` gates (LSTM 4, GRU 3, RNN 1)
and hidden size ``H``:

* ``xp``  ``[T, B, D*G*H]``: projected inputs with the biases that fold in (direction ``d``'s
  gates are columns ``d*G*H .. (d+1)*G*H``, in ONNX gate order: LSTM i o f c, GRU z r h);
* ``r``   ``[D, G*H, H]``: the recurrence weights as ONNX stores them (row ``g*H + j`` is unit
  ``j`` of gate ``g``); with ``rt = W > 0``, their transpose ``R^T [D, H, G*H]`` cut into blocks
  of ``W`` columns, ``[D, G*H / W, H, W]`` (what the phased kernel reads: each block is the
  contiguous ``[H, W]`` its outer products stream; ``W = G*H`` is plain ``R^T``);
* ``h0``  ``[D, B, H]``: the initial hidden state;
* ``lens`` ``[B]`` int32: sequence lengths (``T`` for every row when the model gives none);
* ``aux`` ``[D, A]``: GRU with ``linear_before_reset``: ``Rbh`` (``A = H``); LSTM with peepholes:
  ``P`` (``A = 3H``, order i o f); otherwise unused (``A = 1``);
* ``c0``  ``[D, B, H]`` (LSTM only): the initial cell state.

Outputs: ``Y [T, D, B, H]`` (zero where ``t >= lens[b]``), ``Y_h [D, B, H]`` (the state after
each row's last valid step; zero for a length-0 row, as in onnxruntime) and, for LSTM, ``Y_c [D, B, H]``.
A reverse direction runs ``t = lens[b]-1 .. 0`` (ONNX's reverse within each sequence).

Attributes: ``cell`` ("lstm", "gru", "rnn"), ``hidden``, ``directions`` ("forward"/"reverse"
per direction), ``acts`` (per direction, the ``(name, alpha, beta)`` triples of its
activation functions f, g, h), ``clip`` (< 0: none), ``lbr`` (GRU linear_before_reset),
``input_forget`` (LSTM), ``peephole`` (LSTM: use ``aux``), ``rt`` (``r``'s blocked transpose,
see above; 0: R as ONNX stores it).

The op is opaque (its time loop is sequential) and lowers to one generated kernel
(:mod:`apollo_py.codegen.recurrent`); the numpy reference below is the definition it is tested
against (and what runs on targets without that kernel).
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..ir.types import TensorType
from .registry import DATA_DEPENDENT, REQUIRED, OpDef, register

GATES = {"lstm": 4, "gru": 3, "rnn": 1}
#: activation functions (ONNX names) with the default alpha, beta they take (None: unused)
ACTIVATIONS = {"Sigmoid": (None, None), "Tanh": (None, None), "Relu": (None, None),
               "HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.01, None), "Affine": (1.0, 0.0),
               "ScaledTanh": (1.0, 1.0), "Softsign": (None, None), "Softplus": (None, None)}


def _np_sigmoid(x):
    with np.errstate(over="ignore"):    # exp(-x) = inf for x << 0 gives the right 0
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def np_activation(name: str, alpha: float, beta: float):
    """The numpy function of ONNX activation ``name`` (float32 arithmetic kept)."""
    a, b = np.float32(alpha), np.float32(beta)
    return {"Sigmoid": _np_sigmoid,
            "Tanh": np.tanh,
            "Relu": lambda x: np.maximum(x, np.float32(0)),
            "HardSigmoid": lambda x: np.clip(a * x + b, np.float32(0), np.float32(1)),
            "LeakyRelu": lambda x: np.where(x >= 0, x, a * x),
            "Affine": lambda x: a * x + b,
            "ScaledTanh": lambda x: a * np.tanh(b * x),
            "Softsign": lambda x: x / (np.float32(1) + np.abs(x)),
            "Softplus": lambda x: np.logaddexp(x, np.float32(0))}[name]


def _infer(ins, a):
    cell = a["cell"]
    if cell not in GATES:
        raise ShapeError(f"recurrent: unknown cell {cell!r}")
    want = 6 if cell == "lstm" else 5
    if len(ins) != want:
        raise ShapeError(f"recurrent {cell}: expected {want} inputs, got {len(ins)}")
    xp, r, h0, lens, aux = ins[:5]
    g, h, d = GATES[cell], int(a["hidden"]), len(a["directions"])
    if xp.rank != 3 or xp.shape[2] != d * g * h:
        raise ShapeError(f"recurrent {cell}: projected input {xp.shape} is not [T, B, {d * g * h}]")
    t, b = xp.shape[:2]
    w = int(a.get("rt") or 0)
    if w and (g * h) % w:
        raise ShapeError(f"recurrent {cell}: rt block {w} does not divide {g * h} columns")
    r_shape = (d, g * h // w, h, w) if w else (d, g * h, h)
    if r.shape != r_shape or h0.shape != (d, b, h) or lens.shape != (b,) or aux.rank != 2 \
            or aux.shape[0] != d:
        raise ShapeError(f"recurrent {cell}: operand shapes {r.shape}, {h0.shape}, {lens.shape}, {aux.shape} "
                         f"do not match T={t}, B={b}, D={d}, H={h}")
    if cell == "lstm" and ins[5].shape != (d, b, h):
        raise ShapeError(f"recurrent lstm: initial cell state {ins[5].shape} is not {(d, b, h)}")
    if lens.dtype != "int32" or any(v.dtype != xp.dtype for v in (r, h0, aux, *ins[5:])):
        raise ShapeError("recurrent: lens must be int32 and every other operand of one float dtype")
    outs = [TensorType((t, d, b, h), xp.dtype), TensorType((d, b, h), xp.dtype)]
    if cell == "lstm":
        outs.append(TensorType((d, b, h), xp.dtype))
    return outs


def rt_block(cell: str, hidden: int, dtype: str = "float32") -> int:
    """Columns per block of the blocked R^T the phased kernel reads (the ``rt`` attribute): its
    outer-product block of four vectors (64 float32, 32 float64) where the hidden size is a
    multiple of it, so that a block's ``[H, W]`` is contiguous (64 KiB for hidden 256) instead
    of W columns of rows 4 KiB apart (LSTM hidden 256, one thread's half of the units, T 50:
    0.457 -> 0.278 ms of CPU time, box shared); else ``G * H`` (plain R^T)."""
    w = 32 if dtype == "float64" else 64
    return w if hidden % w == 0 else GATES[cell] * hidden


def rows(r, rt: int = 0):
    """R ``[D, G*H, H]`` from the ``r`` operand (``rt``: its blocked-transpose block width)."""
    r = np.asarray(r)
    if not rt:
        return r
    d, nb, h, w = r.shape
    return r.transpose(0, 2, 1, 3).reshape(d, h, nb * w).transpose(0, 2, 1)


def _reference(xs, a):
    cell, hsz = a["cell"], int(a["hidden"])
    xp, r, h0, lens, aux = (np.asarray(x) for x in xs[:5])
    r = rows(r, int(a.get("rt") or 0))
    dt = xp.dtype.type
    g, nd = GATES[cell], len(a["directions"])
    tlen, batch = xp.shape[:2]
    clip = float(a["clip"])
    y = np.zeros((tlen, nd, batch, hsz), xp.dtype)
    yh = np.array(h0, copy=True)
    yc = np.array(xs[5], copy=True) if cell == "lstm" else None

    def clipped(v):
        return np.clip(v, dt(-clip), dt(clip)) if clip >= 0 else v

    for d, direction in enumerate(a["directions"]):
        f = [np_activation(*act) for act in a["acts"][d]]
        rd = r[d]
        for b in range(batch):
            n = int(min(max(int(lens[b]), 0), tlen))
            h = np.array(h0[d, b], copy=True)
            c = np.array(xs[5][d, b], copy=True) if cell == "lstm" else None
            steps = range(n) if direction == "forward" else range(n - 1, -1, -1)
            for t in steps:
                x = xp[t, b, d * g * hsz:(d + 1) * g * hsz]
                if cell == "rnn":
                    h = f[0](clipped(x + rd @ h))
                elif cell == "lstm":
                    z = x + rd @ h
                    zi, zo, zf, zc = (z[k * hsz:(k + 1) * hsz] for k in range(4))
                    if a["peephole"]:
                        p = aux[d]
                        zi, zf = zi + p[:hsz] * c, zf + p[2 * hsz:] * c
                    i = f[0](clipped(zi))
                    ff = dt(1) - i if a["input_forget"] else f[0](clipped(zf))
                    c = ff * c + i * f[1](clipped(zc))
                    if a["peephole"]:
                        zo = zo + aux[d][hsz:2 * hsz] * c
                    h = f[0](clipped(zo)) * f[2](c)
                else:
                    zr = x[:2 * hsz] + rd[:2 * hsz] @ h
                    zt, rt = f[0](clipped(zr[:hsz])), f[0](clipped(zr[hsz:]))
                    rh = rd[2 * hsz:]
                    if a["lbr"]:
                        ht = f[1](clipped(x[2 * hsz:] + rt * (rh @ h + aux[d])))
                    else:
                        ht = f[1](clipped(x[2 * hsz:] + rh @ (rt * h)))
                    h = (dt(1) - zt) * ht + zt * h
                y[t, d, b] = h
            # a row of length 0 reports a zero state, as onnxruntime does (ONNX leaves it open)
            yh[d, b] = h if n else 0
            if cell == "lstm":
                yc[d, b] = c if n else 0
    return [y, yh] + ([yc] if cell == "lstm" else [])


register(OpDef("recurrent", DATA_DEPENDENT, _infer, _reference, arity=(5, 6),
               attrs={"cell": REQUIRED, "hidden": REQUIRED, "directions": REQUIRED, "acts": REQUIRED,
                      "clip": -1.0, "lbr": 0, "input_forget": 0, "peephole": 0, "rt": 0},
               doc="the time loop of an ONNX LSTM / GRU / RNN over projected inputs (ops/recurrent.py)"))
