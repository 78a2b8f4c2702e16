"""Tuned vs untuned: the seven memory-bound workloads and four zoo models (issue #18, item 2).

For each model: ``apollo_py.tuning.tune`` (budget ``--budget`` seconds, decisions stored in the
cache dir's tuning database), then two executables of the same model in one process -- one
compiled with ``Options(tune="off")`` (the compiler's own choices), one replaying the stored
decisions (``tune="replay"``) -- are run interleaved: ``--rounds`` rounds, each timing ``--reps``
calls of both (the order alternating per round); the table gives the median per-call time of
each and the median of the per-round ratios (untuned / tuned: above 1 = tuning helped).  The
outputs of the two are compared first (max relative difference).

    python benchmarks/tune_bench.py [--quick] [--budget 60] [--zoo-budget 240] [--rounds 7] [--reps 5] [--markdown]
        [--only softmax ...] [--zoo dlrm.dynamo.onnx ...] [--no-zoo] [--cache-dir DIR] [--allow-load]

Zoo models are read from ``~/.cache/apollo_py_zoo`` (benchmarks/zoo/export.py; inputs from its
manifest).  The machine's load (``os.getloadavg``) is printed with every row: on a shared box
the ratios, measured in the same rounds, are the figures to read, not the absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MEMORY_BOUND = ("layernorm", "softmax", "logsoftmax", "bias_gelu", "bias_maxpool", "bias_reducesum",
                "four_branches")
ZOO = ("dlrm.dynamo.onnx", "mobilenetv3_large.dynamo.onnx", "bert_base.dynamo.onnx", "resnet50.dynamo.onnx")
ZOO_DIR = os.path.expanduser("~/.cache/apollo_py_zoo")


def zoo_feeds(entry: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in entry["inputs"]:
        if i["dtype"].startswith("float"):
            feeds[i["name"]] = rng.standard_normal(i["shape"]).astype(i["dtype"])
        else:
            feeds[i["name"]] = rng.integers(0, i.get("high", 10), size=i["shape"]).astype(i["dtype"])
    return feeds


def _time(f, feeds, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f.run(**feeds)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_one(name: str, model, feeds: dict, args, budget: float | None = None) -> dict:
    import apollo_py as ap
    from apollo_py.tuning import tune
    opts = ap.Options(cache_dir=args.cache_dir, progress=False)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = tune(model, options=opts.replace(model_name=name), feeds=feeds, budget=budget or args.budget, repeat=args.repeat,
               progress=False, allow_load=args.allow_load)
    tune_s = time.perf_counter() - t0
    f_off = ap.jit(model, options=opts.replace(tune="off"))
    f_on = ap.jit(model, options=opts)
    a, b = f_off.run(**feeds), f_on.run(**feeds)
    rel = max(float(np.max(np.abs(x.astype(np.float64) - y) / (np.abs(y.astype(np.float64)) + 1e-6)))
              if x.size and x.dtype.kind == "f" else float(np.any(x != y)) for x, y in zip(a, b))
    offs, ons, ratios = [], [], []
    for r in range(args.rounds):
        if r % 2:
            ton, toff = _time(f_on, feeds, args.reps), _time(f_off, feeds, args.reps)
        else:
            toff, ton = _time(f_off, feeds, args.reps), _time(f_on, feeds, args.reps)
        offs.append(toff)
        ons.append(ton)
        ratios.append(toff / ton)
    return {"name": name, "untuned_ms": statistics.median(offs) * 1e3, "tuned_ms": statistics.median(ons) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "pieces": len(res.records), "changed": len(res.changed),
            "changed_kinds": sorted({k.split(":")[0] for k in res.changed}),
            "tune_s": tune_s, "skipped": res.skipped, "max_rel_diff": rel, "confirm": res.confirm_ratio, "slower_rounds": res.slower_rounds,
            "dropped": len(res.rejected), "others_share": res.load.get("others_share"), "refused": bool(res.refused),
            "load": (round(load0, 1), round(os.getloadavg()[0], 1))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small workload sizes")
    p.add_argument("--budget", type=float, default=60.0, help="tuning seconds per workload")
    p.add_argument("--zoo-budget", type=float, default=240.0,
                   help="tuning seconds per zoo model (ResNet-50 has ~30 GEMM pieces: a GEMM round compiles each)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=9, help="the tuner's profiled runs per round")
    p.add_argument("--only", nargs="*", default=None, help="workloads to run (default: the seven)")
    p.add_argument("--zoo", nargs="*", default=list(ZOO), help="zoo files to run")
    p.add_argument("--no-zoo", action="store_true")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "apollo_py_tune_bench"))
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--allow-load", action="store_true",
                   help="store decisions timed while other processes held the cores (the tuner refuses by default)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    import workloads as W
    rows = []
    for name in (args.only if args.only is not None else MEMORY_BOUND):
        wl = W.build(name, quick=args.quick)
        rows.append(bench_one(wl.name, wl.model, dict(wl.inputs), args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if not args.no_zoo:
        manifest = json.load(open(os.path.join(ZOO_DIR, "manifest.json")))
        for fname in args.zoo:
            path = os.path.join(ZOO_DIR, fname)
            rows.append(bench_one(fname.split(".")[0], path, zoo_feeds(manifest[fname]), args, args.zoo_budget))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print("| model | untuned ms | tuned ms | untuned/tuned (min-max) | pieces (changed: kinds) | tuner's check "
              "(dropped) | tuning s (skipped rounds) | max rel diff | load |")
        print("|---|---:|---:|---|---|---|---|---:|---|")
        for r in rows:
            print(f"| {r['name']} | {r['untuned_ms']:.3f} | {r['tuned_ms']:.3f} | {r['ratio']:.2f} "
                  f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['pieces']} ({r['changed']}: "
                  f"{', '.join(r['changed_kinds']) or '-'}) | "
                  f"{'%.2f' % r['confirm'] if r['confirm'] else '-'} ({r['dropped']}) | {r['tune_s']:.0f} ({', '.join(r['skipped']) or '-'}) "
                  f"| {r['max_rel_diff']:.1e} | {r['load'][0]}-{r['load'][1]} |")
    else:
        for r in rows:
            print(f"{r['name']:32s} {r['untuned_ms']:9.3f} {r['tuned_ms']:9.3f} {r['ratio']:6.2f}  "
                  f"{r['changed']}/{r['pieces']} changed  tune {r['tune_s']:.0f}s  load {r['load']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
