"""Graphs shared by the partition tests (built with the builder, as the front end would)."""
import random

import numpy as np

from apollo_py import GraphBuilder
from apollo_py.ir.graph import Graph

F32 = np.float32


def seed_example2():
    """Seed 001, Example 2: elementwise -> elementwise -> reduction -> elementwise."""
    b = GraphBuilder("example2")
    x = b.input("x", (4, 8))
    r = b.reduce_sum(b.neg(b.exp(x)), axes=(1,))
    return b.build([b.sqrt(r)])


def softmax(b, x, axis=-1):
    ax = (x.type.rank + axis) % x.type.rank
    m = b.reduce_max(x, axes=(ax,), keepdims=True)
    e = b.exp(x - m)
    return e / b.reduce_sum(e, axes=(ax,), keepdims=True)


def log_softmax(b, x):
    ax = x.type.rank - 1
    d = x - b.reduce_max(x, axes=(ax,), keepdims=True)
    return d - b.log(b.reduce_sum(b.exp(d), axes=(ax,), keepdims=True))


def layer_norm(b, x, gamma, beta, eps=1e-5):
    ax = x.type.rank - 1
    inv_d = 1.0 / x.shape[-1]
    mean = b.reduce_sum(x, axes=(ax,), keepdims=True) * inv_d
    xc = x - mean
    var = b.reduce_sum(xc * xc, axes=(ax,), keepdims=True) * inv_d
    return xc * b.rsqrt(var + eps) * gamma + beta


def gelu_erf(b, x):
    return x * 0.5 * (1.0 + b.erf(x / np.sqrt(2.0)))


def gelu_tanh(b, x):
    return 0.5 * x * (1.0 + b.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x)))


def softmax_graph(shape=(4, 8)):
    b = GraphBuilder("softmax")
    return b.build([softmax(b, b.input("x", shape))])


def log_softmax_graph(shape=(4, 8)):
    b = GraphBuilder("log_softmax")
    return b.build([log_softmax(b, b.input("x", shape))])


def residual_layernorm_gelu(shape=(4, 16), seed=0):
    """x + r -> LayerNorm -> GELU (erf form)."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("ln_gelu")
    x, r = b.input("x", shape), b.input("r", shape)
    gamma = b.constant(rng.standard_normal(shape[-1:]).astype(F32))
    beta = b.constant(rng.standard_normal(shape[-1:]).astype(F32))
    return b.build([gelu_erf(b, layer_norm(b, x + r, gamma, beta))])


def matmul_bias_relu(m=4, k=16, n=8):
    b = GraphBuilder("mlp")
    x, w = b.input("x", (m, k)), b.input("w", (k, n))
    bias = b.constant(np.arange(n, dtype=F32))
    return b.build([b.relu(b.matmul(x, w) + bias)])


def bert_encoder(layers=12, batch=8, seq=128, hidden=768, heads=12, ffn=3072):
    """Post-LN BERT encoder, weights as graph inputs, explicit softmax attention, tanh GELU."""
    b = GraphBuilder("bert")
    dh = hidden // heads
    h = b.input("x", (batch, seq, hidden))
    mask = b.input("mask", (batch, 1, 1, seq))

    def w(name, shape):
        return b.input(name, shape)

    def heads_of(t):
        return b.transpose(b.reshape(t, shape=(batch, seq, heads, dh)), perm=(0, 2, 1, 3))

    for i in range(layers):
        p = f"l{i}_"
        b.set_source(f"{p}attention")
        q = heads_of(b.matmul(h, w(p + "wq", (hidden, hidden))) + w(p + "bq", (hidden,)))
        k = heads_of(b.matmul(h, w(p + "wk", (hidden, hidden))) + w(p + "bk", (hidden,)))
        v = heads_of(b.matmul(h, w(p + "wv", (hidden, hidden))) + w(p + "bv", (hidden,)))
        scores = b.matmul(q, b.transpose(k, perm=(0, 1, 3, 2))) * (1.0 / np.sqrt(dh)) + mask
        ctx = b.matmul(softmax(b, scores), v)
        ctx = b.reshape(b.transpose(ctx, perm=(0, 2, 1, 3)), shape=(batch, seq, hidden))
        att = b.matmul(ctx, w(p + "wo", (hidden, hidden))) + w(p + "bo", (hidden,))
        b.set_source(f"{p}ln1")
        h = layer_norm(b, att + h, w(p + "g1", (hidden,)), w(p + "b1", (hidden,)))
        b.set_source(f"{p}ffn")
        f = gelu_tanh(b, b.matmul(h, w(p + "w1", (hidden, ffn))) + w(p + "c1", (ffn,)))
        f = b.matmul(f, w(p + "w2", (ffn, hidden))) + w(p + "c2", (hidden,))
        b.set_source(f"{p}ln2")
        h = layer_norm(b, f + h, w(p + "g2", (hidden,)), w(p + "b2", (hidden,)))
    return b.build([h])


N, M = 3, 4
UNARY = ["exp", "neg", "tanh", "abs", "relu", "sigmoid"]
BINARY = ["add", "sub", "mul", "max"]


def random_graph(seed: int, size: int) -> Graph:
    """A random DAG over [N, M] values with [N,1]/[1,M] broadcasts, keepdims reductions,
    reshapes and matmuls; every value keeps shape [N, M] or a broadcastable one."""
    rng = random.Random(seed)
    b = GraphBuilder(f"random{seed}")
    full = [b.input("x0", (N, M)), b.input("x1", (N, M))]
    small = [b.input("c", (N, 1)), b.input("r", (1, M))]
    for _ in range(size):
        kind = rng.choice(["unary", "binary", "binary", "bcast", "reduce", "reshape", "matmul", "const"])
        a = rng.choice(full[-4:] if rng.random() < 0.7 else full)
        if kind == "unary":
            v = getattr(b, rng.choice(UNARY))(a)
        elif kind == "binary":
            v = getattr(b, rng.choice(BINARY))(a, rng.choice(full))
        elif kind == "bcast":
            v = getattr(b, rng.choice(BINARY))(a, rng.choice(small))
        elif kind == "reduce":
            op = rng.choice(["reduce_sum", "reduce_max"])
            ax = rng.choice([0, 1])
            s = getattr(b, op)(a, axes=(ax,), keepdims=True)
            small.append(s)
            v = b.sub(a, s) if rng.random() < 0.5 else b.mul(a, s)
        elif kind == "reshape":
            v = b.reshape(b.reshape(a, shape=(N * M,)), shape=(N, M))
        elif kind == "matmul":
            v = b.matmul(a, b.transpose(rng.choice(full), perm=(1, 0)))   # [N, N]
            v = b.matmul(v, a)                                             # [N, M]
            v = b.tanh(v * 0.1) if rng.random() < 0.5 else v
        else:
            v = a * b.constant(np.full((M,), 0.5, np.float32))
        full.append(v)
    outs = [full[-1]] + ([rng.choice(full[2:-1])] if len(full) > 3 and rng.random() < 0.5 else [])
    return b.build(list(dict.fromkeys(o.name for o in outs)))


def shuffle_graph(graph: Graph, seed: int) -> Graph:
    """The same graph with nodes in another topological order and node outputs renamed."""
    rng = random.Random(seed)
    producers = graph.producers
    deps = {k: {producers[v] for v in n.inputs if v in producers} for k, n in enumerate(graph.nodes)}
    index = {id(n): k for k, n in enumerate(graph.nodes)}
    deps = {k: {index[id(p)] for p in ps} for k, ps in deps.items()}
    done, order = set(), []
    while len(order) < len(graph.nodes):
        ready = [k for k in deps if k not in done and deps[k] <= done]
        k = rng.choice(ready)
        done.add(k)
        order.append(k)
    names = [o for n in graph.nodes for o in n.outputs]
    rng.shuffle(names)
    rename = {o: f"v{rng.randrange(10**9)}_{i}" for i, o in enumerate(names)}
    nodes = [graph.nodes[k].replace(inputs=tuple(rename.get(v, v) for v in graph.nodes[k].inputs),
                                    outputs=tuple(rename[o] for o in graph.nodes[k].outputs), name="")
             for k in order]
    types = {rename.get(v, v): t for v, t in graph.types.items()}
    return Graph(graph.inputs, tuple(rename.get(v, v) for v in graph.outputs), tuple(nodes), types, graph.name)
