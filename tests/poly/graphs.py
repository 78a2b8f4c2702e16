"""Small primitive graphs used by the layer-1 tests (softmax, layernorm, seed listings 1 and 3)."""
from __future__ import annotations

from apollo_py.ir.builder import GraphBuilder


def softmax(rows=4, cols=16):
    b = GraphBuilder("softmax")
    x = b.input("x", [rows, cols])
    m = b.reduce_max(x, axes=(1,), keepdims=True)
    d = b.sub(x, m)
    e = b.exp(d)
    s = b.reduce_sum(e, axes=(1,), keepdims=True)
    y = b.div(e, s)
    return b.build([y])


def layernorm(rows=4, cols=16):
    b = GraphBuilder("layernorm")
    x = b.input("x", [rows, cols])
    inv_n = b.input("inv_n", [])
    eps = b.input("eps", [])
    gamma = b.input("gamma", [cols])
    beta = b.input("beta", [cols])
    s1 = b.reduce_sum(x, axes=(1,), keepdims=True)
    mean = b.mul(s1, inv_n)
    d = b.sub(x, mean)
    sq = b.mul(d, d)
    s2 = b.reduce_sum(sq, axes=(1,), keepdims=True)
    var = b.mul(s2, inv_n)
    v = b.add(var, eps)
    r = b.rsqrt(v)
    y = b.mul(d, r)
    z = b.add(b.mul(y, gamma), beta)
    return b.build([z])


def bias_maxpool(n=1, c=4, h=8, w=8):
    """Seed 001 listing 1: bias add followed by a 2x2 stride-2 max-pool."""
    b = GraphBuilder("bias_maxpool")
    x = b.input("x", [n, c, h, w])
    bias = b.input("bias", [])
    a = b.add(x, bias)
    p = b.window_reduce(a, reducer="max", kernel=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0),
                        dilations=(1, 1))
    return b.build([p])


def bias_reduce13(m=3, n=4, p=5, q=6):
    """Seed 001 listing 3: bias add followed by a sum over axes 1 and 3."""
    b = GraphBuilder("bias_reduce13")
    x = b.input("x", [m, n, p, q])
    bias = b.input("bias", [])
    a = b.add(x, bias)
    r = b.reduce_sum(a, axes=(1, 3))
    return b.build([r])
