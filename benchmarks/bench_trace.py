"""Python-written workloads (issue #19): ``ap.jit`` against ``jax.jit`` and ``torch.compile`` on
the same functions, and plain numpy.

    python benchmarks/bench_trace.py [--quick] [--rounds 11] [--reps 3] [--only NAME ...] [--markdown]

The seven memory-bound workloads of ``workloads.py`` (layernorm, softmax, logsoftmax,
bias_gelu, bias_maxpool, bias_reducesum, four_branches; same sizes and data) written once as
Python against a small array namespace ``xp``: numpy (plain, and traced by ``ap.jit``; the
workload's ONNX model through ``ap.jit`` too, as the same-pipeline reference),
``jax.numpy`` (under ``jax.jit``) and a torch shim (under ``torch.compile``, CPU inductor).
Each contender's first output is checked against plain numpy (rtol 1e-4) before timing.

Timing: all contenders of a workload run in one process, interleaved round-robin after 2
warm-up calls; a sample is the mean of ``reps`` calls and each contender's time is the median of
``rounds`` samples, so background load hits all alike.  Ratios are medians of per-round ratios.
``first call s`` is the wall time of the first call (trace + compile + run).  jax and torch
are optional: absent ones are left out.  ``--threads N`` pins every contender to N threads:
on a shared machine torch's OpenMP threads spin badly when other processes hold the cores
(layernorm [512,768] measured 24 ms per call with 2 threads at load 6, 0.4-0.6 ms with 1).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import apollo_py as ap  # noqa: E402
import workloads as W  # noqa: E402
from contenders import NumpyOps, jax_ops, torch_ops  # noqa: E402

GELU_C = math.sqrt(2.0 / math.pi)


# -- the workloads, written once against xp -----------------------------------------------------

def layernorm(xp, x, scale, bias):
    mean = xp.mean(x, -1, True)
    d = x - mean
    var = xp.mean(d * d, -1, True)
    return d / xp.sqrt(var + 1e-5) * scale + bias


def softmax(xp, x):
    e = xp.exp(x - xp.max(x, -1, True))
    return e / xp.sum(e, -1, True)


def logsoftmax(xp, x):
    s = x - xp.max(x, -1, True)
    return s - xp.log(xp.sum(xp.exp(s), -1, True))


def bias_gelu(xp, x, bias):
    y = x + bias
    return 0.5 * y * (1.0 + xp.tanh(GELU_C * (y + 0.044715 * y * y * y)))


def bias_maxpool(xp, x, bias):
    n, c, h, w = x.shape
    a = x + bias
    return xp.max(a.reshape(n, c, h // 2, 2, w // 2, 2), (3, 5), False)


def bias_reducesum(xp, x, bias):
    return xp.sum(x + bias, (1, 3), False)


def four_branches(xp, x0, x1, x2, x3):
    return xp.concat([xp.sum(xp.exp(x0), -1, True), xp.max(xp.tanh(x1), -1, True),
                     xp.sum(x2 * x2, -1, True), xp.mean(xp.abs(x3), -1, True)], 1)


def _params(name, wl):
    """The workload's parameters (the initializers of its ONNX model) as arrays, by name."""
    from onnx import numpy_helper
    inits = {t.name: numpy_helper.to_array(t) for t in wl.model.graph.initializer}
    if name in ("bias_gelu", "bias_maxpool", "bias_reducesum"):
        return {"bias": inits["bias"]}
    if name == "layernorm":
        return {"scale": inits["scale"], "bias": inits["bias"]}
    return {}


FUNCS = {"layernorm": layernorm, "softmax": softmax, "logsoftmax": logsoftmax, "bias_gelu": bias_gelu,
         "bias_maxpool": bias_maxpool, "bias_reducesum": bias_reducesum, "four_branches": four_branches}


# array namespaces: benchmarks/contenders.py's (numpy, jax, torch), one set for both benchmarks


# -- contenders -------------------------------------------------------------------------------

def contenders(name, wl, args):
    fn = FUNCS[name]
    params = _params(name, wl)
    inputs = [wl.inputs[k] for k in sorted(wl.inputs)]
    out = {}

    def plain(*xs):
        return fn(NumpyOps, *xs, *params.values())
    out["numpy"] = (plain, inputs)
    jf = ap.jit(lambda *xs: fn(NumpyOps, *xs, *params.values()),
                options=ap.Options(num_threads=args.threads) if args.threads else None)
    out["apollo jit"] = (jf, inputs)
    # the same workload's ONNX model through apollo's ONNX import: tracing should cost nothing
    onnx_f = ap.jit(wl.model, options=ap.Options(num_threads=args.threads) if args.threads else None)
    feeds = dict(wl.inputs)
    out["apollo onnx"] = (lambda *xs: onnx_f(**feeds), inputs)
    if not args.no_jax:
        try:
            import jax
            jp = {k: jax.numpy.asarray(v) for k, v in params.items()}
            jx = jax_ops()
            jj = jax.jit(lambda *xs: fn(jx, *xs, *jp.values()))
            jin = [jax.numpy.asarray(x) for x in inputs]
            out["jax.jit"] = (lambda *xs: jj(*xs).block_until_ready(), jin)
        except ImportError:
            pass
    if not args.no_torch:
        try:
            import torch
            if args.threads:
                torch.set_num_threads(args.threads)
            tp = {k: torch.from_numpy(v.copy()) for k, v in params.items()}
            tx = torch_ops()
            tc = torch.compile(lambda *xs: fn(tx, *xs, *tp.values()))
            tin = [torch.from_numpy(x.copy()) for x in inputs]
            out["torch.compile"] = (lambda *xs: tc(*xs), tin)
        except ImportError:
            pass
    return out


def _np(x):
    if hasattr(x, "detach"):
        return x.detach().numpy()
    return np.asarray(x)


def run_workload(name, args) -> dict:
    wl = W.build(name, quick=args.quick)
    cs = contenders(name, wl, args)
    want = None
    compile_s = {}
    for k, (f, ins) in cs.items():
        t = time.perf_counter()
        got = _np(f(*ins))
        compile_s[k] = time.perf_counter() - t
        if want is None:
            want = got
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{name}: {k}")
        f(*ins)
    samples = {k: [] for k in cs}
    for _ in range(args.rounds):
        for k, (f, ins) in cs.items():
            t = time.perf_counter()
            for _ in range(args.reps):
                f(*ins)
            samples[k].append((time.perf_counter() - t) / args.reps)
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(samples["apollo jit"], samples[k]))
             for k in cs if k != "apollo jit"}
    return {"name": wl.name, "ms": {k: v * 1e3 for k, v in med.items()}, "ratio": ratio,
            "compile_s": compile_s, "contenders": list(cs)}


def machine_line() -> str:
    import subprocess
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=HERE).stdout.strip()
    except OSError:
        git = "?"
    vers = [f"Python {platform.python_version()}", f"numpy {np.__version__}"]
    for mod in ("jax", "torch"):
        try:
            vers.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            vers.append(f"{mod} not installed")
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; git {git}; {os.cpu_count()} cores, load "
            f"average {load} at the end; " + ", ".join(vers))


def markdown(rows, args) -> str:
    names = [c for c in rows[0]["contenders"]]
    head = "| workload | " + " | ".join(f"{c} ms" for c in names) + " | " + \
        " | ".join(f"apollo/{c}" for c in names if c != "apollo jit") + " | " + \
        " | ".join(f"{c} first call s" for c in names) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names) + len(names) - 1)]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(f"{r['ms'][c]:.2f}" for c in names) + " | "
                     + " | ".join(f"{r['ratio'][c]:.2f}" for c in names if c != "apollo jit") + " | "
                     + " | ".join(f"{r['compile_s'][c]:.2f}" for c in names) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--quick", action="store_true")
    ap_.add_argument("--rounds", type=int, default=11)
    ap_.add_argument("--reps", type=int, default=3)
    ap_.add_argument("--only", nargs="*", default=None)
    ap_.add_argument("--no-jax", action="store_true")
    ap_.add_argument("--no-torch", action="store_true")
    ap_.add_argument("--markdown", action="store_true")
    ap_.add_argument("--threads", type=int, default=None,
                     help="pin apollo's pool, torch's intra-op threads and XLA (1: no Eigen pool) to N")
    args = ap_.parse_args(argv)
    if args.threads == 1:  # read by XLA when jax first loads, below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1").strip()
    rows = []
    for name in args.only or list(FUNCS):
        r = run_workload(name, args)
        rows.append(r)
        if not args.markdown:
            print(f"{r['name']:<34} " + "  ".join(f"{k} {v:.2f} ms" for k, v in r["ms"].items())
                  + "  | apollo/x: " + "  ".join(f"{k} {v:.2f}" for k, v in r["ratio"].items()),
                  flush=True)
    m = machine_line()
    if args.markdown:
        print(f"- {m}\n- Command: `python benchmarks/bench_trace.py {' '.join(argv or sys.argv[1:])}`\n")
        print(markdown(rows, args))
    else:
        print(m)


if __name__ == "__main__":
    main()
