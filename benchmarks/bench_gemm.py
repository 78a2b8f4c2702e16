"""Generated GEMM vs numpy's sgemm (issue #5: "matmul 1024^3 >= 50% of numpy's sgemm").

    python benchmarks/bench_gemm.py [--rounds 9] [--markdown]

For each shape, three contenders run interleaved round-robin in one process after a warm-up:
numpy ``a @ b`` (OpenBLAS sgemm), apollo_py with ``Options(gemm="generated")`` and apollo_py
with the default ``gemm="auto"`` (which picks BLAS for matmul).  Each sample repeats a call for
about 50 ms, after a 300 ms pause (OpenBLAS's threads spin after a call and would slow the
next contender on a 2-core machine); the table shows median ms and GFLOP/s and the generated/numpy GFLOP/s ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import apollo_py as ap  # noqa: E402

SHAPES = [((1024, 1024), (1024, 1024)), ((512, 512), (512, 512)),
          ((1024, 768), (768, 3072)), ((1024, 3072), (3072, 768)), ((8, 128, 64), (8, 64, 128))]


def _graph(xs, ys):
    b = ap.GraphBuilder("mm")
    return b.build([b.matmul(b.input("x", xs), b.input("w", ys))])


def _sample(fn, sample_s=0.05, settle_s=0.3):
    # OpenBLAS's worker threads busy-wait for a while after each call; on 2 cores they would
    # steal the CPU from whatever is timed next, so every sample starts after a pause
    time.sleep(settle_s)
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < sample_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--markdown", action="store_true", help="print a RESULTS.md table")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for xs, ys in SHAPES:
        x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ys).astype(np.float32)
        flops = 2.0 * np.prod(np.broadcast_shapes(xs[:-2], ys[:-2]) or (1,)) * xs[-2] * xs[-1] * ys[-1]
        gen = ap.jit(_graph(xs, ys), options=ap.Options(gemm="generated"))
        auto = ap.jit(_graph(xs, ys))
        want = x @ w
        for f in (gen, auto):
            np.testing.assert_allclose(f(x, w), want, rtol=1e-4, atol=1e-3 * np.sqrt(xs[-1]))
        fns = {"numpy": lambda: x @ w, "generated": lambda: gen(x, w), "auto": lambda: auto(x, w)}
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                samples[k].append(_sample(fn))
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append((f"{list(xs)}@{list(ys)}", flops, med))
    head = "| shape | numpy ms | generated ms | auto ms | numpy GFLOP/s | generated GFLOP/s | generated/numpy |"
    print(head)
    print("|" + "---|" * 7)
    for name, flops, m in rows:
        print(f"| {name} | {m['numpy'] * 1e3:.2f} | {m['generated'] * 1e3:.2f} | {m['auto'] * 1e3:.2f} | "
              f"{flops / m['numpy'] / 1e9:.0f} | {flops / m['generated'] / 1e9:.0f} | "
              f"{m['numpy'] / m['generated']:.2f} |")
    if args.markdown:
        print(f"\n(median of {args.rounds} interleaved ~50 ms samples; {os.cpu_count()} cores; "
              f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
