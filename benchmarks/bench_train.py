"""Training-step timing (issue #6): the MLP step through ``apollo_py.train_step`` against a plain
numpy step, ``jax.jit`` of the same step (when jax is installed) and the roofline floor.

    python benchmarks/bench_train.py [--batch 256] [--rounds 11] [--reps 5] [--warmup 3]
                                     [--targets reference,cpu,cpu-blas] [--optimizers sgd,adam]
                                     [--threads N] [--repeat N] [--no-jax] [--markdown | --profile]

The model: 784-1024-10 MLP with ReLU, softmax cross-entropy, batch 256, float32; SGD (lr 0.1)
and Adam (lr 1e-3, torch defaults).  Every contender starts from the same weights and its first
loss is checked against the numpy step's (rtol 1e-4) before anything is timed.

Contenders: apollo target "reference" (the numpy oracle), "cpu" (LLVM kernels; matmuls by the
generated GEMM or BLAS per ``Options.gemm="auto"``), "cpu-blas" (target cpu with every matmul
through numpy's BLAS), the plain numpy step of tests/train/mlp_models.py and jax.jit.

Timing: all contenders of one optimizer run in one process, interleaved round-robin after
``warmup`` calls each; a sample is the mean of ``reps`` consecutive calls and each contender's
time is the median of ``rounds`` samples, so background load on a shared machine hits all of
them alike.  Ratios (to the floor, to numpy, to jax) are medians of the per-round ratios.  ``spread`` is the worst (max - min) / median of any contender's samples.

Floor: the step's matmul FLOPs (forward X@W1 and A@W2; backward dW2 = Aᵀ@D, dA = D@W2ᵀ,
dW1 = Xᵀ@dH; the input gradient is not needed) divided by the numpy sgemm rate on the step's
largest product (B x 784 x 1024 into a preallocated output).  The sgemm is one more contender
of the round-robin, so the rate is sampled under the same load as the steps (median of rounds).
No implementation does the step's arithmetic faster than BLAS does its largest product; the
elementwise work (bias, ReLU, softmax, the update) is not in the floor.

Threads: by default every contender uses what it finds (OpenBLAS and apollo's pool: one
thread per core; XLA: its own pool).  ``--threads N`` pins all of them to N (OPENBLAS_NUM_THREADS
and OMP_NUM_THREADS, set by re-running the script, since OpenBLAS reads them at load time;
apollo ``Options(num_threads=N)``; XLA's ``--xla_cpu_multi_thread_eigen=false`` and
``intra_op_parallelism_threads=1`` for N = 1; for N > 1 XLA keeps its default pool).  On a shared machine multi-threaded OpenBLAS
degrades badly when other processes hold the cores (spinning threads), which lowers the
measured sgemm rate and so the floor; ``--threads 1`` gives the stable single-core figures.

``--markdown`` prints the "Training step (issue #6)" section of benchmarks/RESULTS.md.
``--profile`` prints the median time of every runtime step of the cpu training step instead
(measured from outside the runtime; see :func:`profile_cpu_step`).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import apollo_py as ap  # noqa: E402
from tests.train.mlp_models import (NumpyAdam, NumpySGD, mlp_graph, mlp_loss_and_grads,  # noqa: E402
                                mlp_weights)

D, H, C = 784, 1024, 10
SGD_LR, ADAM_LR, BETAS, EPS = 0.1, 1e-3, (0.9, 0.999), 1e-8


def step_flops(batch: int) -> float:
    """Matmul FLOPs of one training step (two forward products, three backward ones)."""
    fwd = 2 * batch * D * H + 2 * batch * H * C
    bwd = 2 * H * batch * C + 2 * batch * C * H + 2 * D * batch * H
    return float(fwd + bwd)


def sgemm_sampler(batch: int):
    """A function that runs numpy sgemm (batch x 784) @ (784 x 1024) into a preallocated output;
    its rate is 2 * batch * 784 * 1024 / time."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((batch, D)).astype(np.float32)
    b = rng.standard_normal((D, H)).astype(np.float32)
    out = np.empty((batch, H), np.float32)
    return lambda: np.matmul(a, b, out=out)


# --- contenders ---------------------------------------------------------------------------


def apollo_step(w0, batch, opt: str, target: str, threads: int | None = None):
    """``target`` is "reference", "cpu", or "cpu-blas" (target cpu with ``Options(gemm="blas")``:
    every matmul through numpy's BLAS instead of the generated GEMM)."""
    optimizer = ap.optim.SGD(lr=SGD_LR) if opt == "sgd" else ap.optim.Adam(lr=ADAM_LR, betas=BETAS, eps=EPS)
    kw = {"num_threads": threads} if threads else {}
    if target == "cpu-blas":
        target, kw["gemm"] = "cpu", "blas"
    step = ap.train_step(mlp_graph(w0, batch), optimizer=optimizer, target=target,
                         options=ap.Options(**kw) if kw else None)
    return lambda x, y: step(labels=y, x=x), step


def numpy_step(w0, opt: str):
    params = {k: v.copy() for k, v in w0.items()}
    o = NumpySGD(SGD_LR) if opt == "sgd" else NumpyAdam(ADAM_LR, BETAS, EPS)

    def run(x, y):
        loss, g = mlp_loss_and_grads(params, x, y)
        o.step(params, g)
        return loss
    return run


def jax_step(w0, opt: str):
    """``jax.jit`` of the same step (float32 on the CPU device), or None without jax.

    Forward, ``jax.value_and_grad`` and the update are one jitted function; parameters and
    optimizer state are passed in and returned (no buffer donation: not every jax CPU build
    honours it).  Inputs are put on the device once, as apollo and numpy read them in place.
    """
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None

    def loss_fn(p, x, y):
        a = jnp.maximum(x @ p["W1"] + p["b1"], 0)
        logp = jax.nn.log_softmax(a @ p["W2"] + p["b2"], axis=1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    b1, b2 = BETAS

    @jax.jit
    def sgd(p, s, t, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return loss, jax.tree_util.tree_map(lambda w, gw: w - SGD_LR * gw, p, g), s

    @jax.jit
    def adam(p, s, t, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        m = jax.tree_util.tree_map(lambda m, gw: m + (gw - m) * (1 - b1), s["m"], g)
        v = jax.tree_util.tree_map(lambda v, gw: b2 * v + (1 - b2) * gw * gw, s["v"], g)
        step_size = (ADAM_LR / (1 - b1 ** t)).astype(jnp.float32)
        sqrt_bc2 = jnp.sqrt(1 - b2 ** t).astype(jnp.float32)
        newp = jax.tree_util.tree_map(lambda w, mm, vv: w - step_size * (mm / (jnp.sqrt(vv) / sqrt_bc2 + EPS)),
                                      p, m, v)
        return loss, newp, {"m": m, "v": v}

    fn = sgd if opt == "sgd" else adam
    state = {"p": {k: jnp.asarray(v) for k, v in w0.items()},
             "s": {"m": {k: jnp.zeros_like(v) for k, v in w0.items()},
                   "v": {k: jnp.zeros_like(v) for k, v in w0.items()}} if opt == "adam" else {},
             "t": 0}
    dev: dict = {}

    def run(x, y):
        if dev.get("key") is not (x, y):
            dev.update(key=(x, y), x=jax.device_put(x), y=jax.device_put(y.astype(np.int32)))
        state["t"] += 1
        loss, state["p"], state["s"] = fn(state["p"], state["s"], np.float64(state["t"]), dev["x"], dev["y"])
        return float(jax.block_until_ready(loss))
    return run


# --- timing -------------------------------------------------------------------------------


def time_interleaved(fns: dict, rounds: int, reps: int, warmup: int) -> dict:
    """name -> list of ``rounds`` samples (seconds per call, mean of ``reps`` calls), taken
    round-robin so that every contender sees the same background load."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples[k].append((time.perf_counter() - t0) / reps)
    return samples


def run_optimizer(opt: str, args, x, y, w0) -> dict:
    """Build, check and time every contender for one optimizer; returns a result row."""
    fns, build_s, notes = {}, {}, []
    want = numpy_step(w0, opt)(x, y)
    contenders = [(f"apollo {t}", t) for t in args.targets] + [("numpy", None)]
    if not args.no_jax:
        contenders.append(("jax.jit", "jax"))
    for name, kind in contenders:
        t0 = time.perf_counter()
        if kind is None:
            fn = numpy_step(w0, opt)
        elif kind == "jax":
            fn = jax_step(w0, opt)
            if fn is None:
                notes.append("jax.jit: n/a (jax is not installed)")
                continue
        else:
            fn, _ = apollo_step(w0, args.batch, opt, kind, args.threads)
        got = fn(x, y)  # first call: compiles (apollo, jax) and runs step 1
        build_s[name] = time.perf_counter() - t0
        if not np.isclose(got, want, rtol=1e-4):
            raise SystemExit(f"{name} ({opt}): first-step loss {got!r} differs from numpy's {want!r}")
        fns[name] = (lambda f: lambda: f(x, y))(fn)
    fns["sgemm"] = sgemm_sampler(args.batch)
    samples = time_interleaved(fns, args.rounds, args.reps, args.warmup)
    med = {k: statistics.median(v) for k, v in samples.items()}
    rate = 2.0 * args.batch * D * H / med.pop("sgemm")
    floor = step_flops(args.batch) / rate
    spread = max((max(v) - min(v)) / statistics.median(v) for k, v in samples.items() if k != "sgemm")
    # ratios: median over rounds of the per-round ratio (a round's contenders and its sgemm sample
    # run back to back, so they share that round's background load)
    floors = [step_flops(args.batch) * t / (2.0 * args.batch * D * H) for t in samples["sgemm"]]
    ratio = {k: {"floor": statistics.median(a / f for a, f in zip(v, floors))} for k, v in samples.items()
             if k != "sgemm"}
    for k in ratio:
        for other in ("numpy", "jax.jit"):
            if other in samples:
                ratio[k][other] = statistics.median(a / b for a, b in zip(samples[k], samples[other]))
    return {"opt": opt, "ms": {k: v * 1e3 for k, v in med.items()}, "ratio": ratio, "build_s": build_s,
            "sgemm_gflops": rate / 1e9, "floor_ms": floor * 1e3, "spread": spread, "notes": notes}


# --- per-step profile ---------------------------------------------------------------------


def profile_cpu_step(w0, x, y, opt: str, threads: int | None, gemm: str = "auto", calls: int = 15) -> list:
    """Per-dispatch times of one compiled target="cpu" training step, on the real call path.

    Sets the executable's ``trace`` list (runtime/cpu.py records ``(schedule index, seconds)``
    per dispatch) and calls the ``TrainStep`` normally.  Returns ``[(median ms, description)]``
    in execution order, then ``("sum", ms)`` and ``("call", ms)`` (the median of whole
    ``TrainStep`` calls, parameter updates included)."""
    kw = {"gemm": gemm, **({"num_threads": threads} if threads else {})}
    optimizer = ap.optim.SGD(lr=SGD_LR) if opt == "sgd" else ap.optim.Adam(lr=ADAM_LR, betas=BETAS, eps=EPS)
    step = ap.train_step(mlp_graph(w0, x.shape[0]), optimizer=optimizer, target="cpu", options=ap.Options(**kw))
    step(labels=y, x=x)
    fn = step._compiled_for(y, {"x": x})
    exe = next(iter(fn._cache.values()))
    if not hasattr(exe, "_schedule"):
        raise SystemExit("--profile: the executable has no dispatch schedule; update profile_cpu_step")
    types = exe.graph.types
    times: list = [[] for _ in exe._schedule]
    call = []
    for _ in range(calls):
        exe.trace = []
        t0 = time.perf_counter()
        step(labels=y, x=x)
        call.append(time.perf_counter() - t0)
        for k, dt in exe.trace:
            times[k].append(dt)
    exe.trace = None
    rows = []
    for (kind, item), ts in zip(exe._schedule, times):
        parts = []
        for s in (item if kind == "kernels" else [item]):
            if getattr(s, "fused", None) is not None:
                what = "kernel " + " ".join(n.op for n in s.fused.nodes)
            elif getattr(s, "desc", None) is not None:
                what = "cblas " + s.desc.formula()
            elif hasattr(s, "execute"):
                what = "generated GEMM + epilogue"
            else:
                what = "numpy " + " ".join(n.op for n in s.nodes)
            parts.append(what + " -> " + ", ".join("x".join(map(str, types[v].shape)) or "scalar" for v in s.outputs))
        rows.append((statistics.median(ts[2:]) * 1e3, " | ".join(parts)))
    return rows + [("sum", sum(r[0] for r in rows)), ("call", statistics.median(call[2:]) * 1e3)]


def profile_text(rows, title: str) -> str:
    out = [title]
    for ms, what in rows[:-2]:
        out.append(f"  {ms:7.3f} ms  {what}")
    out.append(f"  {rows[-2][1]:7.3f} ms  sum of steps; {rows[-1][1]:.3f} ms per TrainStep call")
    return "\n".join(out)


# --- reporting ----------------------------------------------------------------------------


def _git_commit() -> str:
    try:
        c = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "apollo_py"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return c + (" plus uncommitted changes under apollo_py/" if dirty else "")
    except Exception:  # noqa: BLE001
        return "?"


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for ln in open("/proc/cpuinfo").read().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        load = "?"
    try:
        import jax
        jax_v = f"jax {jax.__version__}"
    except ImportError:
        jax_v = "jax not installed"
    try:
        from roofline import blas_info
        b = blas_info()
        blas = f"{b.get('name', '?')} {b.get('version', '')}, kernel {b.get('kernel', '?')}, threads {b.get('threads', '?')}"
    except Exception:  # noqa: BLE001
        blas = "?"
    env = {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ}
    return {"cpu": cpu, "cores": os.cpu_count(), "load": load, "python": platform.python_version(),
            "numpy": np.__version__, "jax": jax_v, "blas": blas, "env": env, "git": _git_commit()}


def _r(row, name: str, base: str) -> str:
    v = row["ratio"].get(name, {}).get(base)
    return f"{v:.2f}" if v is not None else "n/a"


def text_report(rows, args, m) -> str:
    out = [f"MLP {D}-{H}-{C}, batch {args.batch}, float32; median of {args.rounds} samples x {args.reps} calls "
           f"after {args.warmup} warm-up; {m['cores']} cores, load {m['load']}; BLAS {m['blas']}; "
           f"env {m['env'] or 'none'}"]
    for r in rows:
        out.append(f"{r['opt']} (run {r['run']}): numpy sgemm {r['sgemm_gflops']:.1f} GFLOP/s -> floor {r['floor_ms']:.2f} ms "
                   f"({step_flops(args.batch) / 1e9:.3f} GFLOP); spread {r['spread'] * 100:.0f}%")
        for k, v in r["ms"].items():
            out.append(f"  {k:18s} {v:8.2f} ms/step   x{_r(r, k, 'floor')} floor   "
                       f"x{_r(r, k, 'numpy')} numpy   (build + first step {r['build_s'][k]:.2f} s)")
        out.extend("  " + n for n in r["notes"])
    return "\n".join(out)


def markdown(rows, args, m) -> str:
    names = [f"apollo {t}" for t in args.targets] + ["numpy", "jax.jit"]
    cpu = "apollo cpu" if "cpu" in args.targets else None
    head = ["optimizer", "run"] + [f"{n} ms" for n in names] + ["sgemm GFLOP/s", "floor ms"]
    head += [f"{n}/floor" for n in names]
    if cpu:
        head += ["apollo cpu/numpy", "apollo cpu/jax"]
    head += ["spread"]
    lines = ["## Training step (issue #6)", "",
             f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; git {m['git']}",
             f"- Command: `python benchmarks/bench_train.py {' '.join(args.argv)}`".replace("  ", " "),
             f"- Machine: {m['cpu']}, {m['cores']} cores (shared with other processes; load average "
             f"{m['load']} at the end); Python {m['python']}, numpy {m['numpy']}, {m['jax']}",
             f"- BLAS: {m['blas']}; env: "
             + (", ".join(f"{k}={v}" for k, v in m["env"].items()) or "no OPENBLAS_*/OMP_* variables set"),
             f"- Model: MLP {D}-{H}-{C}, ReLU, softmax cross-entropy, batch {args.batch}, float32; "
             f"SGD lr {SGD_LR}, Adam lr {ADAM_LR} betas {BETAS} eps {EPS}",
             f"- Times: median ms per step of {args.rounds} round-robin samples (each the mean of {args.reps} "
             f"calls) after {args.warmup} warm-up calls; `floor` = {step_flops(args.batch) / 1e9:.3f} GFLOP of "
             "step matmuls / numpy sgemm rate on the step's largest product (B x 784 x 1024), sampled in "
             "the same round-robin; ratios are medians of per-round ratios (a round's contenders and "
             "sgemm sample run back to back under the same background load); `spread` = worst "
             "(max-min)/median of any contender's samples", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ms = r["ms"]
        cells = [r["opt"], str(r["run"])] + [f"{ms[n]:.2f}" if n in ms else "n/a" for n in names]
        cells += [f"{r['sgemm_gflops']:.0f}", f"{r['floor_ms']:.2f}"]
        cells += [_r(r, n, "floor") for n in names]
        if cpu:
            cells += [_r(r, cpu, "numpy"), _r(r, cpu, "jax.jit")]
        cells += [f"{r['spread'] * 100:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({n for r in rows for n in r["notes"]})
    builds = "; ".join(f"{r['opt']}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["build_s"].items())
                       for r in rows if r["run"] == 1)
    lines += ["", f"- Build + first step (compile included): {builds}"] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def _pin_threads(n: int) -> None:
    """Set the thread-count variables; re-run this script if OpenBLAS was loaded without them."""
    want = {"OPENBLAS_NUM_THREADS": str(n), "OMP_NUM_THREADS": str(n)}
    if any(os.environ.get(k) != v for k, v in want.items()):
        os.environ.update(want)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:])
    if n == 1:
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=11, help="samples per contender (>= 7)")
    p.add_argument("--reps", type=int, default=5, help="calls per sample")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--targets", default="reference,cpu,cpu-blas",
                   help="apollo targets, comma-separated: reference, cpu, cpu-blas (gemm='blas')")
    p.add_argument("--optimizers", default="sgd,adam")
    p.add_argument("--threads", type=int, default=None, help="pin BLAS, apollo and XLA to N threads")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure everything this many times (one table row per run and optimizer)")
    p.add_argument("--no-jax", action="store_true", help="leave jax.jit out even if installed")
    p.add_argument("--markdown", action="store_true", help="print the RESULTS.md section")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing contenders, print per-step times of the cpu step "
                        "(Options.gemm auto and blas) for each optimizer")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.rounds < 7:
        p.error("--rounds must be at least 7")
    if args.threads is not None:
        _pin_threads(args.threads)
    args.targets = [t for t in args.targets.split(",") if t]
    opts = [o for o in args.optimizers.split(",") if o]
    bad = [o for o in opts if o not in ("sgd", "adam")]
    if bad:
        p.error(f"unknown optimizer(s) {bad}; choose from sgd, adam")

    w0 = mlp_weights((D, H, C))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.batch, D)).astype(np.float32)
    y = rng.integers(0, C, args.batch).astype(np.int64)
    if args.profile:
        for o in opts:
            for gemm in ("auto", "blas"):
                print(profile_text(profile_cpu_step(w0, x, y, o, args.threads, gemm),
                                   f"{o}, target=cpu, Options.gemm={gemm!r}, threads {args.threads or 'default'}:"))
        return
    rows = []
    for rep in range(args.repeat):
        for o in opts:
            rows.append({**run_optimizer(o, args, x, y, w0), "run": rep + 1})
    m = machine()
    print(markdown(rows, args, m) if args.markdown else text_report(rows, args, m))


if __name__ == "__main__":
    main()
