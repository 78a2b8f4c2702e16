"""The model zoo table: compile time, speed and agreement with onnxruntime per exported model.

    python benchmarks/zoo.py [--dir DIR] [--only SUBSTR ...] [--limit 300] [--rounds 5]
                             [--threads 2] [--json PATH] [--write-results]

Models are the files listed in ``DIR/manifest.json`` (benchmarks/zoo/export.py writes them;
default ``$APOLLO_PY_ZOO_DIR`` or ``~/.cache/apollo_py_zoo``; ``--dir tests/models/zoo`` for the
small configurations).  Per model, three new processes:

1. **cold**: an empty cache directory (``Options(cache_dir=...)``), ``apollo_py.jit`` + first
   call, timed in the process; killed after ``--limit`` seconds ("timeout"), with the Python
   stack of every thread dumped a few seconds before (faulthandler) and the last progress line,
   so a hang names the pass it is in.
2. **warm**: the same cache directory, once the cold process's background writer of the
   packed GEMM weights has finished (``entry_wait_s`` in the JSON), ``jit`` + first call
   again, then the run-time contenders
   in the same process: apollo_py (``Options(num_threads=N)``), onnxruntime with all graph
   optimisations and with none (``intra_op_num_threads=N``, no spinning), OpenVINO (CPU,
   ``INFERENCE_PRECISION_HINT=f32``, N threads; where the ``bench`` extra is installed) and
   ``torch.compile`` (default inductor, ``torch.set_num_threads(N)``, ``OMP_WAIT_POLICY=PASSIVE``) of the torch module the
   file was exported from, rebuilt by benchmarks/zoo/zoo_models.py with the export's seed (where
   the ``zoo`` extra is installed; not for the trained models, which have no torch source),
   interleaved in blocks of calls after a warm-up, median of ``--rounds`` rounds
   (benchmarks/run.py's method).  The process is pinned to N CPUs when it has more
   (benchmarks/threads.py).  ``--contenders`` picks the optional ones.  Also
   the step and generated-kernel counts of ``f.plan``, fallback ops (``plan.coverage``), and
   max|Δ|/max|ref| of apollo_py against onnxruntime-all and of onnxruntime-none against
   onnxruntime-all (its own disagreement, the tolerance's yardstick); OpenVINO's and
   torch.compile's are recorded too (``ov_rel_err``, ``tc_rel_err``), and a contender that
   fails or disagrees by more than 1e-2 is left out of the timing with a note.

Timings on a shared machine are only indicative; the table says so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# --------------------------------------------------------------------------------------------
# worker side (runs in a new process)


def _inputs(rec: dict, seed: int = 7) -> dict:
    import numpy as np
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in rec["inputs"]:
        shape = tuple(inp["shape"])
        if "high" in inp:
            feeds[inp["name"]] = rng.integers(0, inp["high"], shape).astype(inp["dtype"])
        else:
            feeds[inp["name"]] = rng.standard_normal(shape).astype(inp["dtype"])
    return feeds


def _rel_err(got, want) -> float:
    import numpy as np
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    worst = 0.0
    for g, w in zip(got, want):
        g = np.asarray(g)
        if g.shape != w.shape:
            return float("inf")
        if w.size:
            d = float(np.max(np.abs(g.astype(np.float64) - w)))
            worst = max(worst, d / max(float(np.max(np.abs(w))), 1e-30))
    return worst


def _ort(path: str, level, threads: int):
    """onnxruntime session as benchmarks/run.py makes one (no spinning pool threads)."""
    from run import _ort_session     # InferenceSession takes a path as well as bytes
    return _ort_session(path, level, threads)


def _time_interleaved(fns: dict, rounds: int, block_s: float = 0.1, settle_s: float = 0.05) -> dict:
    """Median over rounds of the mean ms per call; each round runs every contender for a block of
    calls lasting ~block_s, round-robin, after a warm-up block.  Each block starts ``settle_s``
    after the previous one ends, and the order rotates every round: OpenVINO's TBB workers (and
    OpenBLAS's) spin for a while after a call, and on 2 cores they would slow whichever
    contender always came next (ResNet-50 took 22.7-28.1 ms here without the pause, 20.6 ms
    in a process with only onnxruntime beside it)."""
    reps = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-6)
        reps[name] = max(1, min(1000, int(block_s / one)))
    samples = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, n = fns[name], reps[name]
            time.sleep(settle_s)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def _trace_fusion(log: list) -> None:
    """Wrap layer 1's per-micro-graph fusion step so that each call writes its ops and shapes to
    stderr when it starts ("zoo-fuse-start") and its time when it ends: after a timeout the last
    start without an end names the micro-graph that hung; ``log`` collects (ms, description).
    Diagnostic only; a no-op where the module layout differs."""
    try:
        from apollo_py.layers import layer1
    except ImportError:
        return
    inner = getattr(layer1, "_fuse", None)
    if inner is None or getattr(inner, "_zoo_traced", False):
        return

    def describe(nodes, types):
        ops = " ".join(n.op for n in nodes)
        outs = []
        for n in nodes[-1:]:
            t = types.get(n.outputs[0]) if n.outputs else None
            outs.append(str(list(t.shape)) if t is not None else "?")
        ins = sorted({str(list(types[v].shape)) for n in nodes for v in n.inputs if v in types})
        return f"{len(nodes)} nodes: {ops} | in shapes {' '.join(ins)} -> {' '.join(outs)}"

    def traced(nodes, types, *a, **kw):
        d = describe(nodes, types)
        print(f"zoo-fuse-start {d}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            return inner(nodes, types, *a, **kw)
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            print(f"zoo-fuse-end {ms:.0f} ms", file=sys.stderr, flush=True)
            log.append((ms, d))
    traced._zoo_traced = True
    layer1._fuse = traced


OPTIONAL = ("openvino", "torch.compile")
TRUSTED_REL_ERR = 1e-2  # a contender further than this from onnxruntime is not timed


def _optional_contenders(rec: dict, path: str, feeds: dict, threads: int, want: list, which) -> tuple:
    """OpenVINO-f32 and torch.compile of the source module, as far as installed and working:
    returns (name -> fn, result fields, notes)."""
    from contenders import NA, openvino
    fns, res, notes = {}, {}, {}
    if "openvino" in which:
        try:
            fn, res["ov_compile_s"] = openvino(path, feeds, None, threads)
            res["ov_rel_err"] = _rel_err(fn(), want)
            if res["ov_rel_err"] <= TRUSTED_REL_ERR:
                fns["ov"] = fn
            else:
                notes["openvino"] = f"rel err {res['ov_rel_err']:.1e} against onnxruntime: not timed"
        except NA as exc:
            notes["openvino"] = str(exc)
    if "torch.compile" in which:
        try:
            fns["tc"], res["tc_compile_s"], res["tc_rel_err"] = _torch_compile(rec, feeds, threads, want)
            if res["tc_rel_err"] > TRUSTED_REL_ERR:
                del fns["tc"]
                notes["torch.compile"] = f"rel err {res['tc_rel_err']:.1e} against onnxruntime: not timed"
        except NA as exc:
            notes["torch.compile"] = str(exc)
    return fns, res, notes


def _torch_compile(rec: dict, feeds: dict, threads: int, want: list):
    """torch.compile (default inductor) of the zoo module the file was exported from."""
    from contenders import NA
    # torch's OpenMP threads spin at every barrier by default; on a shared machine a descheduled
    # spinner made DLRM 0.3 s a call instead of 2 ms (onnxruntime runs without spinning too).
    # libgomp reads this when torch loads, and nothing imported torch before this point.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
        sys.path.insert(0, str(HERE / "zoo"))
        import zoo_models
    except ImportError as exc:
        raise NA(f"needs the zoo extra (torch, torchvision, timm, transformers): {exc}") from None
    if rec.get("builder") not in zoo_models.FAMILIES:
        raise NA("no torch source (a trained model shipped as ONNX)")
    torch.set_num_threads(threads)
    try:
        zm = zoo_models.build(rec["builder"], rec.get("size", "full"))  # export.py's seed
    except ImportError as exc:  # torchvision / timm / transformers
        raise NA(f"needs the zoo extra (torch, torchvision, timm, transformers): {exc}") from None
    args = [torch.from_numpy(feeds[n]) for n in zm.input_names]
    mod = torch.compile(zm.module, dynamic=False)
    no_grad = torch.no_grad

    def run():
        with no_grad():
            return mod(*args)
    t0 = time.perf_counter()
    try:
        out = run()
    except Exception as exc:  # noqa: BLE001 - reported as a note
        raise NA(f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}") from None
    compile_s = time.perf_counter() - t0
    out = out if isinstance(out, (tuple, list)) else [out]
    return run, compile_s, _rel_err([o.numpy() for o in out[:len(want)]], want)


def worker(mode: str, path: str, cache_dir: str, threads: int, rounds: int, dump_after: float,
           which=OPTIONAL) -> dict:
    import faulthandler
    if dump_after > 0:  # a hang leaves the stacks on stderr before the parent kills us
        faulthandler.dump_traceback_later(dump_after, exit=False)
    rec = json.loads((Path(path).parent / "manifest.json").read_text())[Path(path).name]
    feeds = _inputs(rec)
    t_import = time.perf_counter()
    import apollo_py
    from apollo_py import Options
    fuse_log: list = []
    if mode == "cold":
        _trace_fusion(fuse_log)
    t0 = time.perf_counter()
    f = apollo_py.jit(path, options=Options(cache_dir=cache_dir, num_threads=threads,
                                            progress=True))
    t_jit = time.perf_counter()
    out = f(**feeds)
    t1 = time.perf_counter()
    res = {"compile_s": t1 - t0, "jit_s": t_jit - t0, "first_call_s": t1 - t_jit,
           "import_s": t0 - t_import}
    faulthandler.cancel_dump_traceback_later()
    if mode == "cold":
        # where the cold compile's time went, per pass (the stages the progress line shows)
        res["progress"] = {name: round(t, 2) for name, t in getattr(getattr(f, "plan", None), "timings", ()) or ()}
        res["fuse_calls"] = len(fuse_log)
        res["fuse_s"] = sum(ms for ms, _ in fuse_log) / 1e3  # nested (split) calls count twice
        res["slowest_fuse"] = [f"{ms:.0f} ms: {d}" for ms, d in sorted(fuse_log, reverse=True)[:3]]
        return res
    import onnxruntime as ort
    lv = ort.GraphOptimizationLevel
    s_all, s_none = _ort(path, lv.ORT_ENABLE_ALL, threads), _ort(path, lv.ORT_DISABLE_ALL, threads)
    want = s_all.run(None, feeds)
    res["rel_err"] = _rel_err(out, want)
    res["ort_none_vs_all"] = _rel_err(s_none.run(None, feeds), want)
    plan = f.plan
    kernels = getattr(plan, "kernels", ()) or ()
    res["steps"] = len(kernels)
    res["kernels"] = sum(1 for k in kernels if getattr(k, "fused", None) is not None
                         or getattr(k, "gemm", None) is not None)
    cov = plan.coverage
    res["fallback"] = cov.fallback_count
    res["fallback_ops"] = sorted({t for _, t, _ in cov.fallback})
    extra, fields, notes = _optional_contenders(rec, path, feeds, threads, want, which)
    res.update(fields)
    res["notes"] = notes
    ms = _time_interleaved({"apollo": lambda: f(**feeds), "ort_all": lambda: s_all.run(None, feeds),
                            "ort_none": lambda: s_none.run(None, feeds), **extra}, rounds)
    res.update({f"{k}_ms": v for k, v in ms.items()})
    return res


# --------------------------------------------------------------------------------------------
# driver side


def _run_worker(mode, path, cache_dir, args) -> dict:
    # the warm one also times contenders; torch.compile's inductor takes minutes on large models
    limit = args.limit if mode == "cold" else args.limit + 120 + (
        600 if "torch.compile" in args.contenders else 0)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, str(path), "--cache", cache_dir,
           "--threads", str(args.threads), "--rounds", str(args.rounds), "--dump-after", str(max(limit - 10, 1)),
           "--contenders", *args.contenders]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        lines = err.splitlines()
        prog = [x for x in lines if x.startswith("apollo_py: compiling")]
        # faulthandler prints the innermost frame first: keep the first thread's innermost frames
        stack = []
        for x in lines:
            if x.startswith(("Thread ", "Current thread ")) and stack:
                break
            if x.strip().startswith("File "):
                stack.append(x.strip())
        open_fuse = []
        for x in lines:  # the fusion calls still running when the stacks were dumped
            if x.startswith("zoo-fuse-start "):
                open_fuse.append(x[len("zoo-fuse-start "):])
            elif x.startswith("zoo-fuse-end ") and open_fuse:
                open_fuse.pop()
        return {"error": "timeout", "limit_s": limit, "last_progress": prog[-1] if prog else None,
                "stack": stack[:12], "hung_in_fuse": open_fuse[-1:]}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return {"error": tail[-1][:300] if tail else f"exit {proc.returncode}",
                "traceback": "\n".join(tail[-14:]), "wall_s": wall}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    prog = [x for x in proc.stderr.splitlines() if x.startswith(("apollo_py: compiling", "apollo_py: compiled"))]
    if prog and not res.get("progress"):    # the child's plan.timings are exact; lines are the fallback
        res["progress"] = _stage_times(prog)
    return res


def _stage_times(lines: list) -> dict:
    """Seconds per stage from the progress lines ('apollo_py: compiling X: STAGE a/b, T s', then
    'apollo_py: compiled X in T s'): from a stage's first line to the next stage's first line or
    the final line.  Progress starts after 2 s, so stages that ended before then are missing and
    the first stage listed also holds what came before it."""
    first, end = {}, None
    for x in lines:
        if x.startswith("apollo_py: compiled "):
            try:
                end = float(x.rsplit(" in ", 1)[1].rstrip(" s"))
            except (IndexError, ValueError):
                pass
            continue
        body = x.split(": ", 2)[-1]
        stage, _, t = body.rpartition(", ")
        stage = stage.rsplit(" ", 1)[0]
        try:
            first.setdefault(stage, float(t.rstrip(" s")))
        except ValueError:
            continue
    names = list(first)
    ends = [first[n] for n in names[1:]] + [end]
    return {n: (round(e - first[n], 2) if e is not None else None) for n, e in zip(names, ends)}


def run_model(path: Path, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="apollo_zoo_cache_") as cache:
        row = {"model": path.name, "loadavg_1m": os.getloadavg()[0],
               "cold": _run_worker("cold", path, cache, args)}
        if "error" in row["cold"]:
            return row
        row["cold"]["entry_wait_s"] = _wait_for_entry(cache)
        row["warm"] = _run_worker("warm", path, cache, args)
    return row


def _wait_for_entry(cache: str, limit: float = 60.0) -> float:
    """Seconds until the cold process's background writers (the model-cache entry's packed
    GEMM weights: frontend/packed_store.py, a forked child nobody waits for) have finished, so
    that "warm" measures a complete cache entry rather than a race with its writer (a warm
    process started meanwhile packs the weights itself: GPT-2 0.62 s instead of 0.33 s)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        busy = [f for _, _, files in os.walk(cache) for f in files if f.startswith(".tmp-")]
        if not busy:
            break
        time.sleep(0.05)
    return round(time.perf_counter() - t0, 2)


def _fmt(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def table(rows: list) -> str:
    head = ("| model | cold s | warm s | apollo ms | ort-all ms | ort-none ms | ov-f32 ms | torch.compile ms "
            "| apollo/ort-all | apollo/ov-f32 | steps | kernels | fallback | rel err | ort none-vs-all "
            "| cold s by pass |")
    out = [head, "|" + "|".join(["---"] * 16) + "|"]
    for r in rows:
        c, w = r["cold"], r.get("warm", {})
        if "error" in c:
            where = (c.get("stack") or [""])[0].replace('File "', "").split("apollo_py/")[-1].replace('", line', ":")
            out.append(f"| {r['model']} | **{c['error'][:80]}** | | | | | | | | | | | | | | {where} |")
            continue
        passes = ", ".join(f"{k} {v:.2f}" for k, v in (c.get("progress") or {}).items() if v >= 0.05)
        if "error" in w:
            out.append(f"| {r['model']} | {c['compile_s']:.1f} | **{w['error'][:80]}** | | | | | | | | | | | | "
                       f"| {passes} |")
            continue
        ratio = w["apollo_ms"] / w["ort_all_ms"] if w.get("ort_all_ms") else None
        ov_ratio = w["apollo_ms"] / w["ov_ms"] if w.get("ov_ms") else None
        fb = f"{w['fallback']} ({', '.join(w['fallback_ops'])})" if w["fallback"] else "0"
        out.append(f"| {r['model']} | {c['compile_s']:.1f} | {w['compile_s']:.2f} | {w['apollo_ms']:.3f} "
                   f"| {w['ort_all_ms']:.3f} | {w['ort_none_ms']:.3f} | {_fmt(w.get('ov_ms'), '.3f')} "
                   f"| {_fmt(w.get('tc_ms'), '.3f')} | {_fmt(ratio)} | {_fmt(ov_ratio)} | {w['steps']} "
                   f"| {w['kernels']} | {fb} | {w['rel_err']:.1e} | {w['ort_none_vs_all']:.1e} | {passes} |")
    return "\n".join(out)


def summary(rows: list) -> str:
    """Issue #14's zoo yardsticks: geomean and worst of apollo/ort-all and apollo/ov-f32 over the
    models that have both times."""
    import math
    out = []
    for label, key in (("ort-all", "ort_all_ms"), ("ov-f32", "ov_ms"), ("torch.compile", "tc_ms")):
        ratios = [(r["warm"]["apollo_ms"] / r["warm"][key], r["model"]) for r in rows
                  if r.get("warm", {}).get("apollo_ms") and r["warm"].get(key)]
        if ratios:
            geo = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
            worst = max(ratios)
            out.append(f"- apollo/{label}: geomean {geo:.2f} over {len(ratios)} models, "
                       f"max {worst[0]:.2f} ({worst[1]})")
    return "\n".join(out)


def tc_table(rows: list) -> str:
    """The torch.compile column on its own: per model with a torch source, apollo_py's and
    torch.compile's ms a call (timed interleaved in one process), their ratio, onnxruntime's ms,
    torch.compile's compile seconds and its max relative error against onnxruntime."""
    out = ["| model | apollo ms | torch.compile ms | apollo/torch.compile | ort-all ms | torch.compile compile s "
           "| torch.compile rel err | load (1 min) |", "|" + "|".join(["---"] * 8) + "|"]
    for r in rows:
        w = r.get("warm", {})
        if "apollo_ms" not in w:
            err = r["cold"].get("error") or w.get("error") or "no result"
            out.append(f"| {r['model']} | **{err[:80]}** | | | | | | {r.get('loadavg_1m', 0):.1f} |")
            continue
        tc = w.get("tc_ms")
        why = (w.get("notes") or {}).get("torch.compile", "")
        out.append(f"| {r['model']} | {w['apollo_ms']:.3f} | {_fmt(tc, '.3f') if tc else '— ' + why[:90]} "
                   f"| {_fmt(w['apollo_ms'] / tc if tc else None)} | {w['ort_all_ms']:.3f} "
                   f"| {_fmt(w.get('tc_compile_s'), '.1f')} | {_fmt(w.get('tc_rel_err'), '.1e')} "
                   f"| {r.get('loadavg_1m', 0):.1f} |")
    return "\n".join(out)


def table_notes(rows: list) -> str:
    """The summary line, then why an optional contender's cell is empty, per model."""
    return "\n".join([summary(rows)] + [f"- {r['model']} / {k}: {why}" for r in rows
                                        for k, why in (r.get("warm", {}).get("notes") or {}).items()]).strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--dump-after", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get(
        "APOLLO_PY_ZOO_DIR", Path.home() / ".cache" / "apollo_py_zoo")))
    ap.add_argument("--only", nargs="*", help="substrings of file names to run")
    ap.add_argument("--limit", type=float, default=300, help="cold-compile wall-time limit per model (s)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="threads for every contender (default 2)")
    ap.add_argument("--contenders", nargs="*", choices=OPTIONAL, default=list(OPTIONAL),
                    help="optional contenders to time where installed (default: all; none: --contenders)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--write-results", action="store_true", help="replace the zoo table in benchmarks/RESULTS.md")
    ap.add_argument("--from-json", nargs="*", type=Path, help="print (and --write-results) the table of "
                    "earlier --json runs instead of running")
    ap.add_argument("--tc-table", action="store_true", help="with --from-json: print the torch.compile table")
    args = ap.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(HERE))
        import threads  # before numpy, onnxruntime, torch or jax load
        threads.limit_threads(args.threads)
        mode, path = args.worker
        print(json.dumps(worker(mode, path, args.cache, args.threads, args.rounds, args.dump_after,
                                args.contenders)))
        return 0
    if args.from_json:
        rows = [r for p in args.from_json for r in json.loads(p.read_text())]
        if args.tc_table:
            print(tc_table(rows) + "\n\n" + summary(rows))
            return 0
        notes = table_notes(rows)
        text = table(rows) + ("\n\n" + notes if notes else "")
        print(text)
        if args.write_results:
            _write_results(text, args, rows)
        return 0
    manifest = json.loads((args.dir / "manifest.json").read_text())
    names = sorted(k for k, v in manifest.items() if "export_error" not in v and (args.dir / k).exists())
    if args.only:
        names = [n for n in names if any(s in n for s in args.only)]
    rows = []
    for name in names:
        row = run_model(args.dir / name, args)
        rows.append(row)
        c, w = row["cold"], row.get("warm", {})
        status = c.get("error") or w.get("error") or \
            f"cold {c['compile_s']:.1f}s warm {w['compile_s']:.2f}s apollo {w['apollo_ms']:.3f}ms " \
            f"ort {w['ort_all_ms']:.3f}ms ov {_fmt(w.get('ov_ms'), '.3f')}ms " \
            f"torch.compile {_fmt(w.get('tc_ms'), '.3f')}ms err {w['rel_err']:.1e}"
        print(f"{name:44s} {status}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    text = table(rows)
    notes = table_notes(rows)
    text = text + ("\n\n" + notes if notes else "")
    print(text)
    if args.write_results:
        _write_results(text, args, rows)
    return 0


def _load_note(rows) -> str:
    loads = [r["loadavg_1m"] for r in rows if "loadavg_1m" in r]
    return f" (1-minute load average {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} cores)" if loads else ""


def _write_results(text: str, args, rows=()) -> None:
    res = HERE / "RESULTS.md"
    doc = res.read_text() if res.exists() else ""
    start, end = "<!-- zoo table start -->", "<!-- zoo table end -->"
    block = (f"{start}\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
             f"{os.cpu_count()} cores, {args.threads} threads, files in `{args.dir}`, cold-compile limit "
             f"{args.limit:.0f} s.  The machine was shared with other jobs{_load_note(rows)}: times are "
             "indicative only.\n\n"
             f"{text}\n\n{end}")
    if start in doc and end in doc:
        doc = doc[:doc.index(start)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip() + "\n\n## Model zoo (benchmarks/zoo.py)\n\n" + block + "\n"
    res.write_text(doc)


if __name__ == "__main__":
    sys.exit(main())
