"""``make fuzz``: differential testing at scale (issue #16 item 3).

Graphs: seeds 0..N-1 of tests/fuzz_graphs.py (float32, float64, int32, int64 and bool graphs),
compiled for "cpu" and compared with "reference".  Mutations: tests/onnx_mutations.py applied
to the small example models and to zoo exports (tests/models/zoo); only ApolloError subclasses
may come out, each naming the node or input (or, for truncated bytes and absurd opsets, the
model).  Prints one line per failure and a summary; exit 1 on any.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--graphs", type=int, default=10_000)
    p.add_argument("--mutations", type=int, default=2_000)
    p.add_argument("--zoo-mutations", type=int, default=300, help="mutations of tests/models/zoo exports")
    args = p.parse_args(argv)
    import fuzz_graphs
    import onnx_mutations
    failures = 0
    per_dtype: dict[str, int] = {}
    t0 = time.perf_counter()
    for seed in range(args.graphs):
        dt = fuzz_graphs.graph_dtype(seed)
        per_dtype[dt] = per_dtype.get(dt, 0) + 1
        try:
            why = fuzz_graphs.check_seed(seed)
        except Exception as e:  # noqa: BLE001 - a crash is a finding: report it and go on
            why = f"seed {seed}: crashed with {type(e).__name__}: {e}"
        if why:
            failures += 1
            print(why, flush=True)
        if (seed + 1) % 1000 == 0:
            print(f"  {seed + 1} graphs, {failures} failing, {time.perf_counter() - t0:.0f} s", flush=True)
    t1 = time.perf_counter()
    print(f"graphs: {args.graphs} tried ({', '.join(f'{k} {v}' for k, v in sorted(per_dtype.items()))}), "
          f"{failures} mismatches/crashes, {t1 - t0:.0f} s", flush=True)
    bad = 0
    seeds = [*range(args.mutations), *range(onnx_mutations.ZOO_SEED0, onnx_mutations.ZOO_SEED0 + args.zoo_mutations)]
    for seed in seeds:
        why = onnx_mutations.check_mutation(seed)
        if why:
            bad += 1
            print(why, flush=True)
    print(f"mutations: {args.mutations} of example models + {args.zoo_mutations} of zoo exports tried, "
          f"{bad} raw exceptions or errors naming no node/input, {time.perf_counter() - t1:.0f} s")
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())
