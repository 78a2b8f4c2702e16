"""Partition-stage timing on a 12-layer BERT-base encoder built with the GraphBuilder.

    python benchmarks/bench_partition.py [--layers 12] [--rounds 5]

The encoder: B=8, S=128, H=768, 12 heads, FFN 3072, post-LN, explicit softmax attention
(reduce_max, sub, exp, reduce_sum, div), tanh GELU; weights are graph inputs (the partition
does not look at their values, and 340 MB of constants would only slow graph building).
Prints the primitive and micro-graph counts and the median of ``rounds`` timings of
``preprocess`` and of ``partition`` (target: partition < 1 s).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import numpy as np

from apollo_py import GraphBuilder, Options
from apollo_py.partition import partition, preprocess


def _softmax(b, x):
    ax = x.type.rank - 1
    e = b.exp(x - b.reduce_max(x, axes=(ax,), keepdims=True))
    return e / b.reduce_sum(e, axes=(ax,), keepdims=True)


def _layer_norm(b, x, gamma, beta, eps=1e-12):
    ax = x.type.rank - 1
    inv_d = 1.0 / x.shape[-1]
    xc = x - b.reduce_sum(x, axes=(ax,), keepdims=True) * inv_d
    var = b.reduce_sum(xc * xc, axes=(ax,), keepdims=True) * inv_d
    return xc * b.rsqrt(var + eps) * gamma + beta


def _gelu_tanh(b, x):
    return 0.5 * x * (1.0 + b.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x)))


def bert_encoder(layers=12, batch=8, seq=128, hidden=768, heads=12, ffn=3072):
    """The post-LN BERT encoder graph (inputs: x, mask, then each layer's weights)."""
    b = GraphBuilder("bert_base")
    dh = hidden // heads
    h = b.input("x", (batch, seq, hidden))
    mask = b.input("mask", (batch, 1, 1, seq))

    def split_heads(t):
        return b.transpose(b.reshape(t, shape=(batch, seq, heads, dh)), perm=(0, 2, 1, 3))

    for i in range(layers):
        p = f"layer{i}."
        w = lambda name, shape: b.input(p + name, shape)  # noqa: E731
        b.set_source(p + "attention")
        q = split_heads(b.matmul(h, w("wq", (hidden, hidden))) + w("bq", (hidden,)))
        k = split_heads(b.matmul(h, w("wk", (hidden, hidden))) + w("bk", (hidden,)))
        v = split_heads(b.matmul(h, w("wv", (hidden, hidden))) + w("bv", (hidden,)))
        scores = b.matmul(q, b.transpose(k, perm=(0, 1, 3, 2))) * (1.0 / np.sqrt(dh)) + mask
        ctx = b.matmul(_softmax(b, scores), v)
        ctx = b.reshape(b.transpose(ctx, perm=(0, 2, 1, 3)), shape=(batch, seq, hidden))
        att = b.matmul(ctx, w("wo", (hidden, hidden))) + w("bo", (hidden,))
        b.set_source(p + "ln1")
        h = _layer_norm(b, att + h, w("g1", (hidden,)), w("b1", (hidden,)))
        b.set_source(p + "ffn")
        f = _gelu_tanh(b, b.matmul(h, w("w1", (hidden, ffn))) + w("c1", (ffn,)))
        f = b.matmul(f, w("w2", (ffn, hidden))) + w("c2", (hidden,))
        b.set_source(p + "ln2")
        h = _layer_norm(b, f + h, w("g2", (hidden,)), w("b2", (hidden,)))
    return b.build([h])


def _median_time(fn, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    opts = Options()
    t0 = time.perf_counter()
    graph = bert_encoder(args.layers)
    t_build = time.perf_counter() - t0
    t_pre, pre = _median_time(lambda: preprocess(graph, opts), args.rounds)
    partition(pre, opts)   # first call fills the per-primitive classification cache (isl)
    t_part, mgs = _median_time(lambda: partition(pre, opts), args.rounds)
    print(f"BERT-base encoder, {args.layers} layers: {len(graph.nodes)} primitives "
          f"({len(pre.nodes)} after preprocess), {len(mgs)} micro-graphs")
    print("  kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(Counter(m.kind for m in mgs).items())))
    print(f"  build graph      {t_build * 1e3:8.1f} ms")
    print(f"  preprocess       {t_pre * 1e3:8.1f} ms  (median of {args.rounds})")
    print(f"  partition        {t_part * 1e3:8.1f} ms  (median of {args.rounds}; target < 1000 ms)")


if __name__ == "__main__":
    main()
