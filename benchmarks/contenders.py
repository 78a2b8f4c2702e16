"""Contenders beside apollo_py and onnxruntime: jax.jit, torch.compile and OpenVINO.

Each adapter takes a workload (benchmarks/workloads.py) and returns a zero-argument callable that
computes the workload once and returns when its output is ready, or raises :class:`NA` with the
reason it cannot (library not installed, compile failure, wrong result).  Libraries are imported
only when an adapter is asked for, so ``import contenders`` stays light.

* ``jax.jit`` runs ``workload.compute`` against :class:`JaxOps` (jax.numpy, jax.nn, lax.conv),
  parameters as device arrays passed to the jitted function (not closed over: XLA would fold
  28 MB of BERT weights into constants);
* ``torch.compile`` (default inductor, CPU) runs it against :class:`TorchOps`
  (torch.nn.functional) in a module whose parameters are buffers, under ``torch.no_grad``;
* OpenVINO runs the workload's ONNX model on the CPU plugin with ``INFERENCE_PRECISION_HINT=f32``
  (its default on bf16-capable CPUs is bf16, which moves results at the 1e-2 level),
  ``INFERENCE_NUM_THREADS`` and the latency hint; outputs are read in place
  (``share_outputs``), as onnxruntime writes its fresh outputs without a copy.

The three namespaces give ``compute`` the same few operations (reductions with numpy's
``axis, keepdims`` order, ``permute``, ``take_rows``, the library normalisations); :class:`NumpyOps`
is the plain-numpy one the tests check the others against.

Threads: ``threads.limit_threads`` (benchmarks/threads.py) must run before numpy, jax or torch
are imported; the adapters set torch's and OpenVINO's thread counts explicitly as well.
"""
from __future__ import annotations

import os

import numpy as np

RTOL, ATOL = 1e-3, 1e-4  # run.py's tolerance against numpy_fn


class NA(Exception):
    """A contender that cannot run this workload; the message says why."""


# --------------------------------------------------------------------------------------------
# array namespaces for Workload.compute

class NumpyOps:
    """Plain numpy; the reference the others are checked against."""

    exp, log, tanh, sqrt, abs = np.exp, np.log, np.tanh, np.sqrt, np.abs

    @staticmethod
    def mean(x, axis, keepdims):
        return np.mean(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def max(x, axis, keepdims):
        return np.max(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def sum(x, axis, keepdims):
        return np.sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def concat(xs, axis):
        return np.concatenate(xs, axis=axis)

    @staticmethod
    def permute(x, perm):
        return np.transpose(x, perm)

    @staticmethod
    def reshape(x, shape):
        return np.reshape(x, shape)

    @staticmethod
    def take_rows(table, idx):
        return table[idx]

    @staticmethod
    def relu(x):
        return np.maximum(x, np.float32(0))

    @staticmethod
    def leaky_relu(x, alpha):
        return np.where(x >= 0, x, np.float32(alpha) * x)

    @staticmethod
    def layer_norm(x, g, b, eps):
        d = x - x.mean(-1, keepdims=True)
        return d / np.sqrt((d * d).mean(-1, keepdims=True) + np.float32(eps)) * g + b

    @staticmethod
    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    @staticmethod
    def log_softmax(x):
        s = x - x.max(-1, keepdims=True)
        return s - np.log(np.exp(s).sum(-1, keepdims=True))

    @staticmethod
    def gelu_tanh(y):
        return 0.5 * y * (1.0 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (y + 0.044715 * y * y * y)))

    @staticmethod
    def conv3x3(x, w, b):
        """3x3 convolution, stride 1, padding 1, NCHW / OIHW (im2col + one matmul)."""
        n, c, h, wd = x.shape
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        cols = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))
        cols = cols.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * wd, c * 9)
        out = cols @ w.reshape(w.shape[0], -1).T
        return out.reshape(n, h, wd, -1).transpose(0, 3, 1, 2) + b[:, None, None]

    @staticmethod
    def maxpool2x2(x):
        n, c, h, w = x.shape
        return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def jax_ops():
    import jax
    import jax.numpy as jnp

    class JaxOps:
        exp, log, tanh, sqrt, abs = jnp.exp, jnp.log, jnp.tanh, jnp.sqrt, jnp.abs
        mean = staticmethod(lambda x, a, k: jnp.mean(x, axis=a, keepdims=k))
        max = staticmethod(lambda x, a, k: jnp.max(x, axis=a, keepdims=k))
        sum = staticmethod(lambda x, a, k: jnp.sum(x, axis=a, keepdims=k))
        concat = staticmethod(lambda xs, a: jnp.concatenate(xs, axis=a))
        permute = staticmethod(jnp.transpose)
        reshape = staticmethod(jnp.reshape)
        take_rows = staticmethod(lambda t, i: jnp.take(t, i, axis=0))
        relu = staticmethod(jax.nn.relu)
        leaky_relu = staticmethod(lambda x, a: jax.nn.leaky_relu(x, a))
        softmax = staticmethod(lambda x: jax.nn.softmax(x, axis=-1))
        log_softmax = staticmethod(lambda x: jax.nn.log_softmax(x, axis=-1))
        gelu_tanh = staticmethod(lambda x: jax.nn.gelu(x, approximate=True))

        @staticmethod
        def layer_norm(x, g, b, eps):  # jax.nn has standardize but no affine layer norm
            return jax.nn.standardize(x, axis=-1, epsilon=eps) * g + b

        @staticmethod
        def conv3x3(x, w, b):
            y = jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)),
                                             dimension_numbers=("NCHW", "OIHW", "NCHW"))
            return y + b[:, None, None]

        @staticmethod
        def maxpool2x2(x):
            return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    return JaxOps


def torch_ops():
    import torch
    import torch.nn.functional as tf

    class TorchOps:
        exp, log, tanh, sqrt, abs = torch.exp, torch.log, torch.tanh, torch.sqrt, torch.abs
        mean = staticmethod(lambda x, a, k: torch.mean(x, dim=a, keepdim=k))
        max = staticmethod(lambda x, a, k: torch.amax(x, dim=a, keepdim=k))
        sum = staticmethod(lambda x, a, k: torch.sum(x, dim=a, keepdim=k))
        concat = staticmethod(lambda xs, a: torch.cat(xs, dim=a))
        permute = staticmethod(torch.permute)
        reshape = staticmethod(torch.reshape)
        take_rows = staticmethod(lambda t, i: tf.embedding(i, t))
        relu = staticmethod(torch.relu)
        leaky_relu = staticmethod(lambda x, a: tf.leaky_relu(x, a))
        layer_norm = staticmethod(lambda x, g, b, eps: tf.layer_norm(x, (x.shape[-1],), g, b, eps))
        softmax = staticmethod(lambda x: tf.softmax(x, -1))
        log_softmax = staticmethod(lambda x: tf.log_softmax(x, -1))
        gelu_tanh = staticmethod(lambda x: tf.gelu(x, approximate="tanh"))
        conv3x3 = staticmethod(lambda x, w, b: tf.conv2d(x, w, b, padding=1))
        maxpool2x2 = staticmethod(lambda x: tf.max_pool2d(x, 2))
    return TorchOps


# --------------------------------------------------------------------------------------------
# adapters

def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def check(got, expected: list, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Raises NA unless ``got`` (one array or a list) matches ``expected`` (a list)."""
    got = [np.asarray(g) for g in _as_list(got)]
    if len(got) != len(expected):
        raise NA(f"{len(got)} outputs, expected {len(expected)}")
    for g, w in zip(got, expected):
        if g.shape != w.shape:
            raise NA(f"WRONG RESULT: shape {g.shape}, expected {w.shape}")
        if not np.allclose(g, w, rtol=rtol, atol=atol):
            raise NA(f"WRONG RESULT: max abs err {float(np.max(np.abs(g.astype(np.float64) - w))):.3g}")


def _need(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NA(f"{module} not installed (pip install -e '.[bench]'): {exc}") from None


def jax_jit(w, expected: list, threads: int):
    """``jax.jit`` of ``w.compute`` on jax.numpy; returns (fn, compile_s).  ``threads`` is
    applied by :func:`limit_threads` (process affinity) before jax loads."""
    import time
    jax = _need("jax")
    if w.compute is None:
        raise NA("workload has no compute function")
    ops = jax_ops()
    params = {k: jax.device_put(v) for k, v in w.params.items()}
    inputs = {k: jax.device_put(v) for k, v in w.inputs.items()}
    jitted = jax.jit(lambda p, kw: w.compute(ops, p, **kw))
    t0 = time.perf_counter()
    try:
        first = jitted(params, inputs)
        jax.block_until_ready(first)
    except Exception as exc:  # noqa: BLE001 - reported as n/a
        raise NA(f"jax.jit failed: {type(exc).__name__}: {str(exc)[:120]}") from None
    compile_s = time.perf_counter() - t0
    check([np.asarray(o) for o in _as_list(first)], expected)
    return (lambda: jax.block_until_ready(jitted(params, inputs))), compile_s


def torch_compile(w, expected: list, threads: int):
    """``torch.compile`` (default inductor backend, CPU) of a module running ``w.compute`` on
    torch ops, with ``torch.set_num_threads(threads)``; returns (fn, compile_s)."""
    import time
    torch = _need("torch")
    if w.compute is None:
        raise NA("workload has no compute function")
    torch.set_num_threads(threads)
    ops = torch_ops()
    names = list(w.params)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k in names:
                self.register_buffer(k, torch.from_numpy(np.ascontiguousarray(w.params[k])))

        def forward(self, **kw):
            return w.compute(ops, {k: getattr(self, k) for k in names}, **kw)

    # every workload's Module shares one forward code object: without a reset, dynamo's
    # per-code cache would hit its recompile limit after 8 workloads and run the rest eagerly;
    # fullgraph makes a graph break an error (reported as n/a) instead of a silent eager part
    torch._dynamo.reset()
    mod = torch.compile(Module().eval(), dynamic=False, fullgraph=True)
    inputs = {k: torch.from_numpy(v) for k, v in w.inputs.items()}
    no_grad = torch.no_grad

    def run():
        with no_grad():
            return mod(**inputs)
    t0 = time.perf_counter()
    try:
        first = run()
    except Exception as exc:  # noqa: BLE001 - inductor needs a C++ compiler, etc.
        raise NA(f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}") from None
    compile_s = time.perf_counter() - t0
    check([o.numpy() for o in _as_list(first)], expected)
    return run, compile_s


def openvino(model, feeds: dict, expected: list | None, threads: int):
    """OpenVINO CPU, f32 precision hint, ``threads`` inference threads, latency hint, for an
    ONNX model (a ModelProto, its bytes or a path); returns (fn, compile_s).  ``expected``
    None skips the check (the zoo compares the outputs itself)."""
    import time
    ov = _need("openvino")
    core = ov.Core()
    t0 = time.perf_counter()
    try:
        if isinstance(model, (str, os.PathLike)):
            src = str(model)
        else:
            src = model if isinstance(model, bytes) else model.SerializeToString()
        m = core.read_model(src)
        compiled = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                 "INFERENCE_NUM_THREADS": threads,
                                                 "PERFORMANCE_HINT": "LATENCY"})
        req = compiled.create_infer_request()
        # match inputs by name: OpenVINO keeps the ONNX input names
        order = [p.get_any_name() for p in compiled.inputs]
        args = {k: np.ascontiguousarray(feeds[k]) for k in order}

        def run():
            res = req.infer(args, share_inputs=True, share_outputs=True)
            return [res[o] for o in compiled.outputs]
        first = run()
    except NA:
        raise
    except Exception as exc:  # noqa: BLE001 - unsupported op, etc.
        raise NA(f"OpenVINO failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}") from None
    compile_s = time.perf_counter() - t0
    if expected is not None:
        check([np.array(o) for o in first], expected)
    return run, compile_s


ADAPTERS = {"jax.jit": jax_jit, "torch.compile": torch_compile}
