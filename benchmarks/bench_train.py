"""Training-step timing: the MLP step through ``apollo_py.train_step`` vs a plain numpy step.

    python benchmarks/bench_train.py [--batch 256] [--rounds 5] [--target reference]

The model: 784-1024-10 MLP with ReLU, softmax cross-entropy, SGD (lr 0.1), batch 256, float32.
Each variant runs ``warmup`` steps, then the median of ``rounds`` timed steps is reported (the
two variants alternate, so background load on a shared machine hits both alike).
The floor is the step's matmul FLOPs (forward 2 products, backward 3: dW2, da, dW1; the input
gradient is not needed) divided by the measured numpy sgemm rate on a product of the step's
own largest shape (B x 784 x 1024, best of 15) — no implementation does that arithmetic faster
than BLAS.

On a shared machine, multi-threaded OpenBLAS degrades badly when other processes hold the cores
(spinning threads); ``OPENBLAS_NUM_THREADS=1`` gives stable single-core figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import apollo_py as ap  # noqa: E402
from tests.train.models import NumpySGD, mlp_graph, mlp_loss_and_grads, mlp_weights  # noqa: E402

D, H, C = 784, 1024, 10


def step_flops(batch: int) -> float:
    fwd = 2 * batch * D * H + 2 * batch * H * C
    bwd = 2 * H * batch * C + 2 * batch * C * H + 2 * D * batch * H
    return float(fwd + bwd)


def sgemm_gflops(batch: int, rounds: int = 15) -> float:
    """Best-of-``rounds`` numpy sgemm rate on (batch x 784) @ (784 x 1024): a peak, so the best
    run (least disturbed by other processes) is the right statistic for a floor."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((batch, D)).astype(np.float32)
    b = rng.standard_normal((D, H)).astype(np.float32)
    out = np.empty((batch, H), np.float32)
    np.matmul(a, b, out=out)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        ts.append(time.perf_counter() - t0)
    return 2 * batch * D * H / min(ts) / 1e9


def _interleaved(fns, rounds: int, warmup: int) -> list[float]:
    """Median time of each function, timed in alternation so that background load on a shared
    machine hits all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    ts = [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def main(argv=None):
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--batch", type=int, default=256)
    ap_.add_argument("--rounds", type=int, default=5)
    ap_.add_argument("--warmup", type=int, default=2)
    ap_.add_argument("--target", default="reference")
    args = ap_.parse_args(argv)

    w0 = mlp_weights((D, H, C))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.batch, D)).astype(np.float32)
    y = rng.integers(0, C, args.batch).astype(np.int64)

    t0 = time.perf_counter()
    step = ap.train_step(mlp_graph(w0, args.batch), optimizer=ap.optim.SGD(lr=0.1), target=args.target)
    step(labels=y, x=x)
    build_s = time.perf_counter() - t0
    ref, opt = {k: v.copy() for k, v in w0.items()}, NumpySGD(0.1)

    def np_step():
        _, g = mlp_loss_and_grads(ref, x, y)
        opt.step(ref, g)
    t_ap, t_np = _interleaved([lambda: step(labels=y, x=x), np_step], args.rounds, args.warmup)

    flops = step_flops(args.batch)
    rate = sgemm_gflops(args.batch)
    floor = flops / (rate * 1e9)
    nodes = len(step.graph_for(y, {"x": x}).nodes)
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"MLP {D}-{H}-{C}, batch {args.batch}, SGD; median of {args.rounds} after {args.warmup} warm-up; "
          f"OPENBLAS_NUM_THREADS={threads}, {os.cpu_count()} cores")
    print(f"  training graph: {nodes} primitive nodes; build + first step {build_s * 1e3:.0f} ms")
    print(f"  apollo_py target={args.target!r}: {t_ap * 1e3:8.2f} ms/step")
    print(f"  plain numpy step:            {t_np * 1e3:8.2f} ms/step")
    print(f"  ratio apollo/numpy:          {t_ap / t_np:8.2f}x")
    print(f"  step matmul work: {flops / 1e9:.3f} GFLOP; "
          f"numpy sgemm ({args.batch}x{D}x{H}): {rate:.1f} GFLOP/s")
    print(f"  roofline floor:              {floor * 1e3:8.2f} ms/step "
          f"(apollo at {floor / t_ap * 100:.0f}% of it, numpy at {floor / t_np * 100:.0f}%)")


if __name__ == "__main__":
    main()
