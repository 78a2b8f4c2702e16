"""VJP rules of the windowed and strided primitives: conv, window_reduce, slice, pad.

Transposed convolutions and strided scatters are written with plain primitives: the output
cotangent is dilated by the stride (:func:`~apollo_py.train.graphs.dilate`: reshape + pad +
reshape + slice), padded, and correlated with the flipped kernel — no new primitive is needed.
Rule signature as in :mod:`apollo_py.train.rules`.
"""
from __future__ import annotations

import itertools

import numpy as np

from .graphs import as_float, dilate, flip, place_strided, zeros


def _spatial(node, xs):
    a = node.attrs
    return tuple(a["strides"]), tuple(a["pads"]), tuple(a["dilations"])


def _conv(b, node, xs, y, g, needs):
    """x: (N, C, *S), w: (M, C/G, *K), y: (N, M, *O)."""
    x, w = xs
    st, pd, dl = _spatial(node, xs)
    grp = node.attrs["group"]
    nsp = len(x.shape) - 2
    n, c = x.shape[:2]
    m = w.shape[0]
    cg, mg = c // grp, m // grp
    ks = w.shape[2:]
    sp = x.shape[2:]
    gx = gw = None
    if needs[0]:
        # dx = conv_transpose(g, w): dilate g by the stride, correlate with the flipped,
        # in/out-swapped kernel at the forward dilation, crop the forward padding.
        gd = g
        for s in range(nsp):
            gd = dilate(b, gd, 2 + s, st[s])
        wt = b.reshape(w, shape=(grp, mg, cg) + ks)
        wt = b.transpose(wt, perm=(0, 2, 1) + tuple(range(3, 3 + nsp)))
        wt = b.reshape(wt, shape=(c, mg) + ks)
        wt = flip(b, wt, tuple(range(2, 2 + nsp)))
        full = [sp[s] + pd[s] + pd[nsp + s] for s in range(nsp)]
        begin = [dl[s] * (ks[s] - 1) for s in range(nsp)]
        end = [full[s] - gd.shape[2 + s] for s in range(nsp)]
        gxp = b.conv(gd, wt, strides=(1,) * nsp, pads=tuple(begin + end), dilations=dl, group=grp)
        gx = b.slice(gxp, starts=(0, 0) + pd[:nsp],
                     ends=(n, c) + tuple(pd[s] + sp[s] for s in range(nsp)), steps=(1,) * (2 + nsp))
    if needs[1]:
        # dw[m, c, k] = sum_{n, o} g[n, m, o] x_pad[n, c, o*s + k*d]: a conv whose batch is the
        # in-group channel, whose channels are (group, batch), with stride d and dilation s.
        xt = b.reshape(x, shape=(n, grp, cg) + sp)
        xt = b.transpose(xt, perm=(2, 1, 0) + tuple(range(3, 3 + nsp)))
        xt = b.reshape(xt, shape=(cg, grp * n) + sp)
        gt = b.reshape(g, shape=(n, grp, mg) + g.shape[2:])
        gt = b.transpose(gt, perm=(1, 2, 0) + tuple(range(3, 3 + nsp)))
        gt = b.reshape(gt, shape=(m, n) + g.shape[2:])
        r = b.conv(xt, gt, strides=dl, pads=pd, dilations=st, group=grp)  # (cg, M, K'...)
        if r.shape[2:] != ks:
            r = b.slice(r, starts=(0,) * (2 + nsp), ends=(cg, m) + ks, steps=(1,) * (2 + nsp))
        gw = b.transpose(r, perm=(1, 0) + tuple(range(2, 2 + nsp)))
    return [gx, gw]


def _window_sum(b, node, x, g):
    a = node.attrs
    k, st, pd, dl = (tuple(a[n]) for n in ("kernel", "strides", "pads", "dilations"))
    nsp = len(k)
    lead = len(x.shape) - nsp
    gd = g
    for s in range(nsp):
        gd = dilate(b, gd, lead + s, st[s])
    sp = x.shape[lead:]
    full = [sp[s] + pd[s] + pd[nsp + s] for s in range(nsp)]
    begin = [dl[s] * (k[s] - 1) for s in range(nsp)]
    end = [full[s] - gd.shape[lead + s] for s in range(nsp)]
    gxp = b.window_reduce(gd, reducer="sum", kernel=k, strides=(1,) * nsp, pads=tuple(begin + end),
                          dilations=dl)
    r = len(x.shape)
    return b.slice(gxp, starts=(0,) * lead + pd[:nsp],
                   ends=x.shape[:lead] + tuple(pd[s] + sp[s] for s in range(nsp)), steps=(1,) * r)


def _window_max(b, node, x, y, g):
    """Each window's cotangent goes to the elements equal to its maximum (ties split evenly)."""
    a = node.attrs
    k, st, pd, dl = (tuple(a[n]) for n in ("kernel", "strides", "pads", "dilations"))
    nsp = len(k)
    lead = len(x.shape) - nsp
    r = len(x.shape)
    sp = x.shape[lead:]
    full = [sp[s] + pd[s] + pd[nsp + s] for s in range(nsp)]
    xp = b.pad(x, pads=(0,) * lead + pd[:nsp] + (0,) * lead + pd[nsp:], value=float(-np.inf))
    masks = []
    for off in itertools.product(*(range(kk) for kk in k)):
        starts = (0,) * lead + tuple(off[s] * dl[s] for s in range(nsp))
        ends = x.shape[:lead] + tuple(starts[lead + s] + (y.shape[lead + s] - 1) * st[s] + 1
                                      for s in range(nsp))
        xk = b.slice(xp, starts=starts, ends=ends, steps=(1,) * lead + st)
        masks.append((starts, as_float(b, b.eq(xk, y), g.dtype)))
    count = masks[0][1]
    for _, mk in masks[1:]:
        count = b.add(count, mk)
    share = b.div(g, count)
    total = None
    for starts, mk in masks:
        part = b.mul(share, mk)
        for s in range(nsp):
            part = place_strided(b, part, lead + s, starts[lead + s], st[s], full[s])
        total = part if total is None else b.add(total, part)
    return b.slice(total, starts=(0,) * lead + pd[:nsp],
                   ends=x.shape[:lead] + tuple(pd[s] + sp[s] for s in range(nsp)), steps=(1,) * r)


def _window_reduce(b, node, xs, y, g, needs):
    if node.attrs["reducer"] == "sum":
        return [_window_sum(b, node, xs[0], g)]
    return [_window_max(b, node, xs[0], y, g)]


def _slice(b, node, xs, y, g, needs):
    x = xs[0]
    a = node.attrs
    out = g
    for ax, (s0, e0, st0) in enumerate(zip(a["starts"], a["ends"], a["steps"])):
        sl = slice(s0, None if e0 is not None and e0 < 0 else e0, st0)
        start, _, step = sl.indices(x.shape[ax])
        n = out.shape[ax]
        if step < 0:
            out = flip(b, out, (ax,))
            start, step = start + (n - 1) * step, -step
        if n == x.shape[ax] and step == 1:
            continue
        out = place_strided(b, out, ax, start, step, x.shape[ax])
    return [out]


def _pad(b, node, xs, y, g, needs):
    x = xs[0]
    a = node.attrs
    p = tuple(a["pads"])
    r = len(x.shape)
    if a["mode"] == "constant":
        # padded entries are constants; cropped (negative-pad) entries get zero cotangent
        return [b.pad(g, pads=tuple(-v for v in p))]
    # reflect / edge / wrap: per axis, the pad is a gather with a fixed index table, so its
    # transpose is a scatter_add with the same table (applied last axis first).
    from . import prims  # noqa: F401
    shapes = [x.shape]
    tables = []
    for ax in range(r):
        lo, hi = max(-p[ax], 0), x.shape[ax] - max(-p[r + ax], 0)
        idx = np.pad(np.arange(lo, hi), (max(p[ax], 0), max(p[r + ax], 0)), mode=a["mode"])
        tables.append(idx.astype(np.int64))
        shapes.append(shapes[-1][:ax] + (len(idx),) + shapes[-1][ax + 1:])
    out = g
    for ax in reversed(range(r)):
        if len(tables[ax]) == x.shape[ax] and np.array_equal(tables[ax], np.arange(x.shape[ax])):
            continue
        idx = b.constant(tables[ax])
        out = b.op("scatter_add", zeros(b, shapes[ax], g.dtype), idx, out, axis=ax)[0]
    return [out]


RULES = {"conv": _conv, "window_reduce": _window_reduce, "slice": _slice, "pad": _pad}
