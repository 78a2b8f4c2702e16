"""The tuner's GEMM candidates, each GEMM on its own: which blocking / split / thread choices win
on this machine for a model's generated GEMMs and implicit-GEMM convs (issue #18, item 2).

    python benchmarks/tune_gemm.py MODEL.onnx [--rounds 7] [--reps 10] [--top 12] [--json FILE]

Compiles the model with ``Options(tune="off")``, collects its distinct generated GEMMs (the
tuner's ``gemm:`` pieces, with how many steps each is), compiles every candidate
``tuning/space.py: gemm_candidates`` offers for each (one change from the default), and times
default and candidates interleaved round-robin in one process on random operands of the real
sizes: per round the median of ``--reps`` calls each; the row gives each candidate's median of
per-round ratios candidate / default (below 1: faster).  The summary weights each piece by its
default time x instance count: "best" is the model's GEMM time with every piece's best candidate
(below 0.95 only), as a fraction of the default.  The box may be shared: print ``uptime`` next
to the numbers (the lead reruns it quiet).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _arrays(d, rng):
    from apollo_py.codegen.gemm import b_source_size
    a = rng.standard_normal(d.a_batches * d.m * d.k if d.a_view is None else d.a_view.size).astype(np.float32)
    b = rng.standard_normal(b_source_size(d)).astype(np.float32)
    ops = [rng.standard_normal(o.shape).astype(o.dtype) for o in d.operands]
    return a, b, ops


def pieces(path: str, feeds: dict | None = None):
    """(key -> (desc, instances)) of the model's generated GEMMs, compiled untuned."""
    import apollo_py as ap
    from apollo_py.runtime.gemm_step import gemm_key
    f = ap.jit(path, options=ap.Options(tune="off", progress=False))
    if feeds is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tune_bench import ZOO_DIR, zoo_feeds
        man = json.load(open(os.path.join(ZOO_DIR, "manifest.json")))
        feeds = zoo_feeds(man[os.path.basename(path)])
    f.run(**feeds)
    exe = f.specialization({k: v.shape for k, v in feeds.items()})
    out: dict = {}
    for s in exe.steps:
        cg = getattr(s, "compiled", None)
        if type(s).__name__ == "GemmStep" and getattr(cg, "blocking", None) is not None:
            k = gemm_key(cg.desc)
            out[k] = (cg.desc, out.get(k, (None, 0))[1] + 1)
    return out


def bench_piece(d, threads: int, rounds: int, reps: int) -> dict:
    from apollo_py.codegen.gemm import compile_gemm
    from apollo_py.runtime.cpu import thread_pool
    from apollo_py.runtime.gemm_step import tuned_blocking
    from apollo_py.tuning.space import gemm_candidates
    pool = thread_pool(threads)
    rng = np.random.default_rng(0)
    a, b, ops = _arrays(d, rng)
    cands = {"default": {}, **gemm_candidates(d, {}, threads)}
    compiled = {}
    for label, dec in cands.items():
        bl, one = tuned_blocking(d, dec)
        cg = compile_gemm(d, 1 if one else threads, bl)
        if one is not None:
            cg.inline = one
        compiled[label] = cg
    outs = [np.empty(d.stored_shape, dt) for dt in d.out_dtypes]
    for cg in compiled.values():        # warm: constant packing, first-touch
        cg.run(pool, a, b, ops, outs)
    times = {k: [] for k in compiled}
    for r in range(rounds):
        order = list(compiled) if r % 2 == 0 else list(reversed(compiled))
        for label in order:
            cg = compiled[label]
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                cg.run(pool, a, b, ops, outs)
                ts.append(time.perf_counter() - t0)
            times[label].append(statistics.median(ts))
    base = times["default"]
    return {"default_ms": statistics.median(base) * 1e3,
            "ratios": {k: statistics.median(t / b0 for t, b0 in zip(v, base)) for k, v in times.items() if k != "default"},
            "decisions": {k: v for k, v in cands.items() if k != "default"}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=int(os.cpu_count() or 1))
    p.add_argument("--top", type=int, default=0, help="only the N pieces with the most default time")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    ps = pieces(args.model)
    rows = []
    for k, (d, n) in ps.items():
        rows.append({"key": k, "instances": n, "shape": f"{d.batch}x{d.m}x{d.n}x{d.k}" + (" conv" if d.conv else ""),
                     **bench_piece(d, args.threads, 1, 3)})      # a quick look to rank the pieces
    rows.sort(key=lambda r: -r["default_ms"] * r["instances"])
    if args.top:
        rows = rows[:args.top]
    for r in rows:
        d = ps[r["key"]][0]
        r.update(bench_piece(d, args.threads, args.rounds, args.reps))
        best = min(r["ratios"].items(), key=lambda kv: kv[1], default=("-", 1.0))
        print(f"{r['shape']:>22s} x{r['instances']:<2d} {r['default_ms']:8.3f} ms  best {best[0]:9s} {best[1]:.2f}  "
              + " ".join(f"{k}={v:.2f}" for k, v in r["ratios"].items()), flush=True)
    total = sum(r["default_ms"] * r["instances"] for r in rows)
    tuned = sum(r["default_ms"] * r["instances"] * min([v for v in r["ratios"].values() if v < 0.95] or [1.0])
                for r in rows)
    wins: dict = {}
    for r in rows:
        for k, v in r["ratios"].items():
            wins.setdefault(k, [0, 0])
            wins[k][0] += 1
            wins[k][1] += v < 0.95
    print(f"GEMM time {total:.2f} ms; with each piece's best candidate (< 0.95 only): {tuned:.2f} ms "
          f"({tuned / total if total else 1:.2f}); load {load0:.1f}-{os.getloadavg()[0]:.1f}")
    print("candidate wins (< 0.95) / offered: " + ", ".join(f"{k} {w}/{n}" for k, (n, w) in wins.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
