"""Models written once against an ``nn`` namespace: ``ap.nn`` (traced) or :class:`NumpyNN`
(plain numpy, the independent reference)."""
import math

import numpy as np


class NumpyNN:
    """Plain-numpy versions of the ap.nn helpers (written independently of apollo_py)."""

    @staticmethod
    def relu(x):
        return np.maximum(x, 0)

    @staticmethod
    def softmax(x, axis=-1):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)

    @staticmethod
    def log_softmax(x, axis=-1):
        s = x - x.max(axis=axis, keepdims=True)
        return s - np.log(np.exp(s).sum(axis=axis, keepdims=True))

    @staticmethod
    def layer_norm(x, scale=None, bias=None, axis=-1, eps=1e-5):
        m = x.mean(axis=-1, keepdims=True)
        v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
        y = (x - m) / np.sqrt(v + eps)
        y = y * scale if scale is not None else y
        return y + bias if bias is not None else y

    @staticmethod
    def gelu(x, approximate=False):
        erf = np.vectorize(math.erf)
        return (0.5 * x * (1 + erf(x / math.sqrt(2)))).astype(x.dtype)

    @staticmethod
    def conv2d(x, w, b=None, stride=1, padding=0):
        xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
        kh, kw = w.shape[2:]
        cols = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
        y = np.einsum("nchwij,ocij->nohw", cols, w)
        return y + b[None, :, None, None] if b is not None else y

    @staticmethod
    def max_pool2d(x, k):
        n, c, h, w = x.shape
        return x.reshape(n, c, h // k, k, w // k, k).max(axis=(3, 5))

    @staticmethod
    def embedding(ids, table):
        return table[ids]

    @staticmethod
    def attention(q, k, v, mask=None, scale=None, causal=False):
        s = q @ np.swapaxes(k, -1, -2) / np.asarray(math.sqrt(q.shape[-1]), q.dtype)
        if causal:
            n = s.shape[-1]
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        return NumpyNN.softmax(s) @ v


def jax_nn():
    """The NumpyNN helpers on jax.numpy (for comparing gradients with jax.grad)."""
    import jax
    import jax.numpy as jnp

    class JaxNN:
        relu = staticmethod(lambda x: jnp.maximum(x, 0))
        softmax = staticmethod(lambda x, axis=-1: jax.nn.softmax(x, axis=axis))
        log_softmax = staticmethod(lambda x, axis=-1: jax.nn.log_softmax(x, axis=axis))
        gelu = staticmethod(lambda x, approximate=False: jax.nn.gelu(x, approximate=False))
        embedding = staticmethod(lambda ids, table: table[ids])

        @staticmethod
        def layer_norm(x, scale=None, bias=None, axis=-1, eps=1e-5):
            m = x.mean(axis=-1, keepdims=True)
            v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
            y = (x - m) / jnp.sqrt(v + eps)
            y = y * scale if scale is not None else y
            return y + bias if bias is not None else y

        @staticmethod
        def conv2d(x, w, b=None, stride=1, padding=0):
            y = jax.lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2)
            return y + b[None, :, None, None] if b is not None else y

        @staticmethod
        def max_pool2d(x, k):
            n, c, h, w = x.shape
            return x.reshape(n, c, h // k, k, w // k, k).max(axis=(3, 5))

        @staticmethod
        def attention(q, k, v, mask=None, scale=None, causal=False):
            s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
            if causal:
                n = s.shape[-1]
                s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
            return jax.nn.softmax(s, axis=-1) @ v
    return JaxNN


def mlp(nn, p, x):
    return nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def conv_block(nn, p, x):
    y = nn.relu(nn.conv2d(x, p["w"], p["b"], padding=1))
    return nn.max_pool2d(y, 2)


def _heads(t, h):
    b, s, d = t.shape
    return t.reshape(b, s, h, d // h).transpose(0, 2, 1, 3)


def attention_block(nn, p, x, heads=2, causal=True):
    b, s, d = x.shape
    q, k, v = (_heads(x @ p[n], heads) for n in ("wq", "wk", "wv"))
    o = nn.attention(q, k, v, causal=causal)
    return o.transpose(0, 2, 1, 3).reshape(b, s, d) @ p["wo"]


def transformer(nn, p, ids):
    """Two pre-LN layers (causal attention + GELU MLP) over token embeddings; log-probs out."""
    x = nn.embedding(ids, p["emb"]) + p["pos"]
    for layer in p["layers"]:
        x = x + attention_block(nn, layer, nn.layer_norm(x, layer["ln1_g"], layer["ln1_b"]))
        h = nn.gelu(nn.layer_norm(x, layer["ln2_g"], layer["ln2_b"]) @ layer["w1"] + layer["b1"])
        x = x + h @ layer["w2"]
    return nn.log_softmax(nn.layer_norm(x, p["lnf_g"], p["lnf_b"]) @ p["out"])


def init(seed, dtype=np.float32, d=16, vocab=11, seq=6, ffn=32):
    rng = np.random.default_rng(seed)

    def r(*s, scale=0.3):
        return (rng.standard_normal(s) * scale).astype(dtype)

    def layer():
        return {"wq": r(d, d), "wk": r(d, d), "wv": r(d, d), "wo": r(d, d),
                "ln1_g": 1 + r(d, scale=0.1), "ln1_b": r(d, scale=0.1),
                "ln2_g": 1 + r(d, scale=0.1), "ln2_b": r(d, scale=0.1),
                "w1": r(d, ffn), "b1": r(ffn, scale=0.1), "w2": r(ffn, d)}
    return {
        "mlp": {"w1": r(12, 20), "b1": r(20), "w2": r(20, 5), "b2": r(5)},
        "conv": {"w": r(6, 3, 3, 3), "b": r(6)},
        "attn": {"wq": r(d, d), "wk": r(d, d), "wv": r(d, d), "wo": r(d, d)},
        "transformer": {"emb": r(vocab, d), "pos": r(seq, d), "layers": [layer(), layer()],
                        "lnf_g": 1 + r(d, scale=0.1), "lnf_b": r(d, scale=0.1), "out": r(d, vocab)},
        "x_mlp": r(7, 12, scale=1.0), "x_conv": r(2, 3, 8, 8, scale=1.0), "x_attn": r(2, 6, d, scale=1.0),
        "ids": rng.integers(0, vocab, size=(2, seq)).astype(np.int64),
    }


#: name -> (model function, its parameters' key in init(), its input's key): the models the
#: trace tests run (test_models.py against numpy, test_grad.py against finite differences)
CASES = {
    "mlp": (mlp, "mlp", "x_mlp"),
    "conv_block": (conv_block, "conv", "x_conv"),
    "attention_block": (attention_block, "attn", "x_attn"),
    "transformer": (transformer, "transformer", "ids"),
}
