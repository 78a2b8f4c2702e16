"""apollo_py.distributed on a local Ray instance: inference throughput with 1 and 2 actors, data-
parallel step time against one process, the collective's cost, and a projection to 8 and 64
workers from the measured per-step communication volume.

    python benchmarks/bench_distributed.py [--rows 1024] [--batch 32] [--steps 20] [--out FILE]

Prints a markdown section (for RESULTS.md).  Timings on a shared machine are noisy: the load
average is printed next to them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "models" / "zoo"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _inputs(entry, rows, rng):
    out = {}
    for spec in entry["inputs"]:
        shape = (rows, *spec["shape"][1:])
        if spec["dtype"].startswith("int"):
            out[spec["name"]] = rng.integers(0, spec.get("high", 2), shape).astype(spec["dtype"])
        else:
            out[spec["name"]] = rng.standard_normal(shape).astype(spec["dtype"])
    return out


def bench_inference(ray, name, rows, batch, lines):
    import apollo_py as ap
    from apollo_py.distributed import predictor
    entry = json.loads((ZOO / "manifest.json").read_text())[name]
    rng = np.random.default_rng(0)
    data = _inputs(entry, rows, rng)
    example = {k: v[:batch] for k, v in data.items()}
    f = ap.jit(str(ZOO / name))
    f(**example)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for i in range(0, rows, batch):
            f(**{k: v[i:i + batch] for k, v in data.items()})
        times.append(time.perf_counter() - t)
    local = rows / min(times)
    per_batch_local = min(times) / (rows // batch)
    items = [{"id": i, **{k: v[i] for k, v in data.items()}} for i in range(rows)]
    ds = ray.data.from_items(items).materialize()
    res = {}
    for actors in (1, 2):
        # each batch records when it finished and how long the model ran, so the steady rate
        # (first completion to last) and Ray's share per batch leave start-up and compiles out
        base = predictor(str(ZOO / name), example=example)

        class Timed(base):
            def __call__(self, batch):
                t = time.perf_counter()
                out = super().__call__(batch)
                n = len(batch["id"])
                out["t_run"] = np.full(n, time.perf_counter() - t)
                out["t_done"] = np.full(n, time.time())
                return out
        t = time.perf_counter()
        out = ds.map_batches(Timed, concurrency=actors, batch_size=batch, batch_format="numpy",
                             num_cpus=1).take_all()
        wall = time.perf_counter() - t
        assert len(out) == rows
        done = np.array([r["t_done"] for r in out])
        run = np.array([r["t_run"] for r in out])
        steady = (rows - batch) / (done.max() - done.min())
        per_batch_actor = actors * batch / steady       # wall seconds one actor spends a batch
        overhead = per_batch_actor - float(np.median(run))
        res[actors] = (steady, wall, overhead, float(np.median(run)))
    lines.append(f"| {name} | {batch} | {local:.0f} | {res[1][0]:.0f} | {res[2][0]:.0f} | "
                 f"{res[2][0] / res[1][0]:.2f} | {res[1][1]:.1f} / {res[2][1]:.1f} | "
                 f"{res[1][3] * 1e3:.1f} ({per_batch_local * 1e3:.1f}) | {res[1][2] * 1e3:.1f} / "
                 f"{res[2][2] * 1e3:.1f} | {load()} |")


def bench_training(ray, steps, lines):
    import apollo_py as ap
    from apollo_py.distributed import DataParallel
    sys.path.insert(0, str(ROOT))
    from tests.train.mlp_models import mlp_onnx, mlp_weights
    model = mlp_onnx(mlp_weights((784, 1024, 10)))
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((256, 784)).astype(np.float32), rng.integers(0, 10, 256))
               for _ in range(steps + 3)]
    opt = ap.optim.Adam(1e-3)
    ref = ap.train_step(model, optimizer=opt, options=ap.Options(num_threads=1))
    dp = DataParallel(ap.train_step(model, optimizer=opt), 2)
    one, wall, comm, comp, inside = [], [], [], [], []
    for k, (x, y) in enumerate(batches):   # interleaved: both see the same load
        t = time.perf_counter()
        ref(labels=y, x=x)
        t1 = time.perf_counter()
        dp.step(labels=y, x=x)
        t2 = time.perf_counter()
        if k >= 3:
            one.append(t1 - t)
            wall.append(t2 - t1)
            comm.append(dp.comm_seconds)
            comp.append(dp.compute_seconds)
            inside.append(dp.worker_seconds)
    volume = dp.comm_bytes
    dp.shutdown()
    m = statistics.median
    over = m([w - i for w, i in zip(wall, inside)])   # step wall time outside the workers' work
    lines.append(f"| MLP 784-1024-10, Adam, global batch 256 | {m(one) * 1e3:.1f} | {m(wall) * 1e3:.1f} | "
                 f"{m(comp) * 1e3:.1f} | {m(comm) * 1e3:.1f} | {over * 1e3:.1f} | "
                 f"{volume / 1e6:.2f} | {load()} |")
    return {"one": m(one), "wall": m(wall), "comm": m(comm), "comp": m(comp), "over": over,
            "volume": volume}


def bench_allreduce(ray, lines):
    """ray.util.collective (GLOO = torch.distributed gloo) against torch.distributed called
    directly (what Ray Train's TorchTrainer uses) on the same actors' process pairs."""
    import socket

    @ray.remote(num_cpus=1)
    class A:
        def col(self, world, rank, group):
            import ray.util.collective as col
            col.init_collective_group(world, rank, backend="gloo", group_name=group)
            self.group = group

        def torch_init(self, world, rank, port):
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world)

        def run(self, kind, n, reps):
            a = np.ones(n, np.float32)
            if kind == "col":
                import ray.util.collective as col
                op = lambda: col.allreduce(a, group_name=self.group)  # noqa: E731
            else:
                import torch
                import torch.distributed as dist
                t = torch.from_numpy(a)
                op = lambda: dist.all_reduce(t)  # noqa: E731
            op()
            ts = []
            for _ in range(reps):
                s = time.perf_counter()
                op()
                ts.append(time.perf_counter() - s)
            return statistics.median(ts)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    col_pair = [A.remote() for _ in range(2)]
    ray.get([a.col.remote(2, r, "bench") for r, a in enumerate(col_pair)])
    res = {}
    for n in (1024, 262144, 1048576):
        res[("col", n)] = max(ray.get([a.run.remote("col", n, 30) for a in col_pair]))
    for a in col_pair:
        ray.kill(a)
    torch_pair = [A.remote() for _ in range(2)]
    ray.get([a.torch_init.remote(2, r, port) for r, a in enumerate(torch_pair)])
    for n in (1024, 262144, 1048576):
        res[("torch", n)] = max(ray.get([a.run.remote("torch", n, 30) for a in torch_pair]))
    for a in torch_pair:
        ray.kill(a)
    for n in (1024, 262144, 1048576):
        lines.append(f"| {n * 4 / 1e6:.3f} | {res[('col', n)] * 1e3:.2f} | {res[('torch', n)] * 1e3:.2f} | {load()} |")
    # alpha-beta fit of the 2-worker allreduce through ray.util.collective
    small, big = res[("col", 1024)], res[("col", 1048576)]
    beta = (1048576 - 1024) * 4 / (big - small)   # bytes/s
    return small, beta


def projection(train, alpha, beta, lines):
    """Ring allreduce (what gloo's CPU allreduce does for large buffers): every worker sends and
    receives 2 (N-1)/N of the buffer in 2 (N-1) messages."""
    v = train["volume"]
    for bw_name, bw in (("loopback, measured", beta), ("10 GbE (1.25 GB/s)", 1.25e9)):
        for n in (2, 8, 64):
            t_comm = 2 * (n - 1) * alpha / 2 + 2 * (n - 1) / n * v / bw   # alpha: 2-rank round
            step = train["comp"] + t_comm + train["over"]
            lines.append(f"| {n} | {bw_name} | {2 * (n - 1) / n * v / 1e6:.2f} | {t_comm * 1e3:.1f} | "
                         f"{step * 1e3:.1f} | {train['comp'] / step:.0%} | {n * 128 / step:.0f} |")


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--rows", type=int, default=1024)
    ap_.add_argument("--batch", type=int, default=32)
    ap_.add_argument("--steps", type=int, default=20)
    ap_.add_argument("--models", default="resnet_small.dynamo.onnx,bert_small.dynamo.onnx")
    ap_.add_argument("--out")
    args = ap_.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    lines = [f"Machine: {os.cpu_count()} cores, shared with other users; load average at start: {load()}",
             "", "Inference (`distributed.predictor` on `map_batches`, pieces shipped; samples/s from the "
             "first batch's completion to the last, so actor start-up and compiles are left out; "
             "Ray overhead = an actor's wall time per batch minus the model's run time in it):", "",
             "| model | batch | local loop samples/s | 1 actor | 2 actors | 2/1 | wall s incl. start-up (1 / 2 actors) | "
             "model ms/batch in the actor (local) | Ray overhead ms/batch (1 / 2 actors) | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        for name in args.models.split(","):
            bench_inference(ray, name, args.rows, args.batch, lines)
        lines += ["", "Data-parallel training (2 workers x 128 vs one process x 256, one thread each; "
                  "medians of the steps after 3 warm-up steps):", "",
                  "| model | 1 process ms/step | 2 workers ms/step | compute ms (slowest worker) | "
                  "allreduce ms (incl. waiting for the slower worker) | Ray overhead ms | MB all-reduced per worker per step | load |",
                  "|---|---|---|---|---|---|---|---|"]
        train = bench_training(ray, args.steps, lines)
        lines += ["", "Allreduce of float32 buffers between 2 actors (median of 30):", "",
                  "| MB | ray.util.collective GLOO ms | torch.distributed gloo ms | load |", "|---|---|---|---|"]
        alpha, beta = bench_allreduce(ray, lines)
        lines += ["", f"Projection (weak scaling: 128 rows per worker; ring allreduce of the measured "
                  f"{train['volume'] / 1e6:.2f} MB, latency {alpha * 1e3:.2f} ms per 2-rank round, "
                  f"loopback bandwidth {beta / 1e9:.2f} GB/s; compute {train['comp'] * 1e3:.1f} ms and "
                  f"Ray overhead {train['over'] * 1e3:.1f} ms per step as measured):", "",
                  "| workers | network | MB sent per worker | allreduce ms | step ms | compute share | "
                  "samples/s |", "|---|---|---|---|---|---|---|"]
        projection(train, alpha, beta, lines)
    finally:
        ray.shutdown()
    lines.append(f"\nLoad average at end: {load()}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
