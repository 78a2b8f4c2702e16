"""Benchmark harness: numpy vs onnxruntime (all / no graph optimisations) vs jax.jit vs
torch.compile vs OpenVINO vs apollo_py.

    python benchmarks/run.py [--only NAME ...] [--forms both|exporter|decomposed] [--rounds 5]
                             [--threads 2] [--target cpu] [--quick] [--write-results]
                             [--label TEXT] [--native-blas] [--json PATH]

For each workload (benchmarks/workloads.py), in each of its forms (the normalisations as the
standard ops exporters write, and decomposed into primitives), all contenders live in one
process and are timed interleaved round-robin (A B C ... A B C ...), after a warm-up, median of
the rounds.  Each sample repeats a call enough times to last ~50 ms (10 ms with --quick) and
records the mean per call.  Contenders whose runtime accepts caller-provided outputs are timed
twice: with fresh outputs and with ``out=`` (onnxruntime through IOBinding).  jax.jit,
torch.compile and OpenVINO (benchmarks/contenders.py) run where installed (the ``bench`` extra)
and are n/a with a note where not.  Every contender gets ``--threads`` threads (default 2): the
process is pinned to that many CPUs when it has more (XLA sizes its pool from the affinity),
onnxruntime's intra-op threads, torch.set_num_threads, OpenVINO's INFERENCE_NUM_THREADS and
apollo_py's ``Options.num_threads`` are set to it.  See benchmarks/README.md.

--native-blas removes OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE from THIS process's environment
before numpy is imported, so OpenBLAS picks its native kernel; nothing else is changed (tests
and other processes keep the environment they had).  The kernel that runs is reported.
"""
from __future__ import annotations

import os
import sys

# --native-blas and --threads must act before numpy (and its OpenBLAS), jax or torch is loaded.
_BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_REMOVED_BLAS_ENV = {}
if "--native-blas" in sys.argv[1:]:
    for _k in _BLAS_VARS:
        if _k in os.environ:
            _REMOVED_BLAS_ENV[_k] = os.environ.pop(_k)


def _threads_arg(argv) -> int:
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv) and argv[i + 1].isdigit():
            return max(1, int(argv[i + 1]))
        if a.startswith("--threads=") and a.split("=", 1)[1].isdigit():
            return max(1, int(a.split("=", 1)[1]))
    return 2


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # imported (by zoo.py, tests), it leaves the process as it is
    import threads as _threads_mod
    THREADS_NOTE = _threads_mod.limit_threads(_threads_arg(sys.argv[1:]))
else:
    THREADS_NOTE = "not set (run.py imported as a module)"

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

import contenders  # noqa: E402
import roofline  # noqa: E402
import workloads  # noqa: E402
from contenders import NA  # noqa: E402

RTOL, ATOL = contenders.RTOL, contenders.ATOL
CONTENDERS = ["numpy", "ort-all", "ort-all out=", "ort-none", "jax.jit", "torch.compile", "openvino",
              "apollo", "apollo out="]
# the acceptance's yardstick (issue #14): apollo against the fastest of these in the same run
RIVALS = ("ort-all", "jax.jit", "torch.compile")


# --------------------------------------------------------------------------------------------
# contenders


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _close(got, want) -> tuple[bool, str]:
    got, want = _as_list(got), _as_list(want)
    if len(got) != len(want):
        return False, f"{len(got)} outputs, expected {len(want)}"
    worst = 0.0
    for g, w in zip(got, want):
        g = np.asarray(g)
        if g.shape != w.shape:
            return False, f"shape {g.shape}, expected {w.shape}"
        if not np.allclose(g, w, rtol=RTOL, atol=ATOL):
            return False, f"max abs err {float(np.max(np.abs(g.astype(np.float64) - w))):.3g}"
        worst = max(worst, float(np.max(np.abs(g.astype(np.float64) - w))) if g.size else 0.0)
    return True, f"max abs err {worst:.3g}"


def _ort_session(model_bytes: bytes, level, threads: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    # ORT's pool threads otherwise spin-wait after each run and steal the (2) cores from
    # whichever contender runs next in the interleaved schedule.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def _ort_iobinding(sess, inputs: dict, expected: list):
    bufs = [np.empty(e.shape, e.dtype) for e in expected]  # C order, unlike empty_like
    binding = sess.io_binding()
    for k, v in inputs.items():
        binding.bind_cpu_input(k, v)
    for out, buf in zip(sess.get_outputs(), bufs):
        binding.bind_output(out.name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
    def run(binding=binding, bufs=bufs):  # the closure keeps the bound buffers alive
        sess.run_with_iobinding(binding)
    return run, bufs


def _short(exc: BaseException, limit: int = 160) -> str:
    msg = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_contenders(w, expected: list, target: str, threads: int):
    """Returns (callables: name -> fn or NA message, info: dict with compile seconds)."""
    import onnxruntime as ort
    fns: dict = {}
    info: dict = {"compile_s": None, "jit_s": None, "notes": {}}
    model_bytes = w.model.SerializeToString()
    inputs = w.inputs

    fns["numpy"] = lambda: w.numpy_fn(**inputs)

    s_all = _ort_session(model_bytes, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, threads)
    s_none = _ort_session(model_bytes, ort.GraphOptimizationLevel.ORT_DISABLE_ALL, threads)
    for name, sess in (("ort-all", s_all), ("ort-none", s_none)):
        ok, why = _close(sess.run(None, inputs), expected)
        if not ok:  # the workload itself is wrong: the harness stops on it
            raise AssertionError(f"{w.name}: onnxruntime ({name}) disagrees with numpy_fn: {why}")
        fns[name] = (lambda s=sess: s.run(None, inputs))
    try:
        fn, bufs = _ort_iobinding(s_all, inputs, expected)
        fn()
        ok, why = _close(bufs, expected)
        fns["ort-all out="] = fn if ok else NA(f"IOBinding output wrong: {why}")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        fns["ort-all out="] = NA(_short(exc))

    info["contender_compile_s"] = {}
    adapters = {**contenders.ADAPTERS,
                "openvino": lambda w, expected, threads: contenders.openvino(w.model, inputs, expected, threads)}
    for name, adapter in adapters.items():
        try:
            fns[name], info["contender_compile_s"][name] = adapter(w, expected, threads)
        except NA as exc:
            fns[name] = exc
        except Exception as exc:  # noqa: BLE001 - a contender's own failure is a note, not fatal
            fns[name] = NA(_short(exc))

    # apollo_py: every failure (import, front end, compile, run) is reported as n/a.
    try:
        import apollo_py as ap
        t0 = time.perf_counter()
        f = ap.jit(w.model, target=target, options=ap.Options(num_threads=threads))
        t1 = time.perf_counter()
        first = f.run(**inputs)
        t2 = time.perf_counter()
        info["jit_s"], info["compile_s"] = t1 - t0, t2 - t0
        ok, why = _close(first, expected)
        if not ok:
            info["notes"]["apollo"] = f"WRONG RESULT ({why}); timed anyway"
        fns["apollo"] = lambda: f(**inputs)
    except Exception as exc:  # noqa: BLE001
        msg = _short(exc)
        fns["apollo"] = NA(msg)
        fns["apollo out="] = NA("apollo n/a")
        info["notes"]["apollo"] = msg
        if os.environ.get("APOLLO_BENCH_TRACEBACK"):
            traceback.print_exc()
        return fns, info
    try:
        bufs = [np.empty(e.shape, e.dtype) for e in expected]  # C order, unlike empty_like
        out_arg = bufs[0] if len(bufs) == 1 else bufs
        f(**inputs, out=out_arg)
        ok, why = _close(bufs, expected)
        if ok:
            fns["apollo out="] = lambda: f(**inputs, out=out_arg)
        else:
            fns["apollo out="] = NA(f"out= accepted but outputs not written correctly ({why})")
    except Exception as exc:  # noqa: BLE001
        fns["apollo out="] = NA(f"out= not supported: {_short(exc, 100)}")
    return fns, info


# --------------------------------------------------------------------------------------------
# timing

def _calibrate(fn, sample_s: float) -> int:
    """Calls per sample so that a sample lasts about ``sample_s`` (fn already warmed up)."""
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    if dt >= sample_s:
        return 1
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < sample_s / 2 and n < 1000:
        fn()
        n += 1
    per = (time.perf_counter() - t0) / max(n, 1)
    return max(1, min(10000, math.ceil(sample_s / per)))


def time_interleaved(fns: dict, rounds: int, sample_s: float) -> dict:
    """Median seconds per call for each runnable contender, sampled round-robin."""
    live = {k: f for k, f in fns.items() if not isinstance(f, NA)}
    for f in live.values():  # warm-up
        f()
    reps = {k: _calibrate(f, sample_s) for k, f in live.items()}
    samples: dict = {k: [] for k in live}
    for _ in range(rounds):
        for k, f in live.items():
            n = reps[k]
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            samples[k].append((time.perf_counter() - t0) / n)
    return {k: {"median_s": statistics.median(v), "samples_s": v, "reps": reps[k]}
            for k, v in samples.items()}


# --------------------------------------------------------------------------------------------
# reporting

def _ms(x) -> str:
    if x is None:
        return "n/a"
    ms = x * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


HEADER = ["workload", "form", "triad GB/s", "sgemm GFLOP/s", "floor ms", *CONTENDERS,
          "apollo compile s", "apollo/ort-all", "apollo/ort-none", "apollo/best", "best", "apollo/openvino",
          "apollo/floor", "numpy/floor", "spread"]


def spread(times: dict) -> str:
    """Worst (max - min) / median over the contenders' samples: how noisy this row is."""
    vals = [(max(v["samples_s"]) - min(v["samples_s"])) / v["median_s"]
            for v in times.values() if v and v["median_s"] > 0]
    return f"{100 * max(vals):.0f}%" if vals else "n/a"


def table_rows(results: list) -> list:
    rows = []
    for r in results:
        t = {k: (v["median_s"] if v else None) for k, v in r["times"].items()}
        ap = t.get("apollo")
        rivals = {k: t[k] for k in RIVALS if t.get(k) is not None}
        best = min(rivals, key=rivals.get) if rivals else None
        rows.append([r["name"], r.get("form") or "-", f"{r['triad_gbps']:.1f}", f"{r['sgemm_gflops']:.0f}",
                     _ms(r["floor_s"]), *(_ms(t.get(c)) for c in CONTENDERS),
                     "n/a" if r["compile_s"] is None else f"{r['compile_s']:.2f}",
                     _ratio(ap, t.get("ort-all")), _ratio(ap, t.get("ort-none")),
                     _ratio(ap, rivals.get(best)), best or "n/a", _ratio(ap, t.get("openvino")),
                     _ratio(ap, r["floor_s"]), _ratio(t.get("numpy"), r["floor_s"]),
                     spread(r["times"])])
    return rows


def markdown_table(rows: list) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(HEADER, *rows)]
    def line(cells):
        return "| " + " | ".join(str(c).ljust(wd) for c, wd in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (wd + 2) for wd in widths) + "|"
    return "\n".join([line(HEADER), sep] + [line(r) for r in rows])


def summary_line(results: list) -> str | None:
    """Issue #14's yardstick over the run: apollo against the fastest of ort-all, jax.jit and
    torch.compile per row (geomean, and the rows where apollo is slower)."""
    ratios = []
    for r in results:
        t = {k: (v["median_s"] if v else None) for k, v in r["times"].items()}
        rivals = [t[k] for k in RIVALS if t.get(k)]
        if t.get("apollo") and rivals:
            ratios.append((t["apollo"] / min(rivals), f"{r['name']} {r.get('form', '')}".strip()))
    if not ratios:
        return None
    geo = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
    slower = [f"{n} ({x:.2f})" for x, n in ratios if x > 1]
    return (f"- apollo/best: geomean {geo:.2f} over {len(ratios)} rows; slower than the best in "
            f"{len(slower)}" + (": " + ", ".join(slower) if slower else ""))


def notes_text(results: list) -> list:
    out = [x for x in [summary_line(results)] if x]
    for r in results:
        for k in CONTENDERS:
            why = r["na"].get(k)
            if why and not (k == "apollo out=" and "apollo" in r["na"]):
                out.append(f"- {r['name']} {r.get('form', '')} / {k}: n/a — {why}")
        for k, why in r["notes"].items():
            if k not in r["na"]:  # e.g. a wrong result that was timed anyway
                out.append(f"- {r['name']} {r.get('form', '')} / {k}: {why}")
    return out


def _cpu_model() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def machine_info(roof) -> dict:
    import onnxruntime as ort
    try:
        import apollo_py
        ap_ver = getattr(apollo_py, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        ap_ver = f"import failed: {_short(exc)}"
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "apollo_py"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = ", plus uncommitted changes under apollo_py/" if dirty else ""
    except Exception:  # noqa: BLE001
        commit, dirty = "?", ""
    others = {}
    for mod in ("jax", "torch", "openvino"):
        try:
            others[mod] = getattr(__import__(mod), "__version__", "?").split("-")[0]
        except Exception:  # noqa: BLE001 - not installed: its column is n/a
            others[mod] = "not installed"
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "loadavg_start": _loadavg(), "python": platform.python_version(),
            "numpy": np.__version__, "onnxruntime": ort.__version__, "apollo_py": ap_ver, "others": others,
            "threads": THREADS_NOTE,
            "git": commit, "dirty": dirty, "triad_method": roof.detail.get("triad", {}).get("method", "?"),
            "blas": roofline.blas_info(), "removed_env": _REMOVED_BLAS_ENV,
            "triad_gbps": roof.bw_gbps, "triad_by_threads": roof.detail.get("triad", {}).get("by_threads"),
            "sgemm_gflops": roof.sgemm_gflops, "sgemm_n": roof.detail.get("sgemm_n"),
            "sgemm_best_gflops": roof.detail.get("sgemm_best_gflops")}


def _blas_line(b: dict) -> str:
    parts = [f"{b.get('name', '?')} {b.get('version', '')}".strip(),
             f"kernel {b.get('kernel', 'unknown')}", f"threads {b.get('threads', '?')}",
             f"(via {b.get('source', '?')})"]
    env = {k: v for k, v in b.get("env", {}).items() if v is not None}
    parts.append("env: " + (", ".join(f"{k}={v}" for k, v in env.items()) if env else
                            "no OPENBLAS_*/OMP_* variables set"))
    return "; ".join(parts)


RESULTS_HOWTO = """\
How to run (benchmarks/README.md has the details): `pip install -e '.[dev,bench]'` (jax.jit and
OpenVINO; `make bench` installs it), torch for torch.compile from the `zoo` extra or the CPU
wheel (`pip install torch --index-url https://download.pytorch.org/whl/cpu`), then on a quiet
machine `python benchmarks/run.py --rounds 9 --write-results --append --label "..."` (every
workload, exporter and decomposed forms, numpy / onnxruntime all and none / jax.jit /
torch.compile / OpenVINO-f32 / apollo_py interleaved in one process, 2 threads each:
`--threads`) and `make zoo ZOO_ARGS="--write-results"` (the zoo table, with OpenVINO-f32 and
torch.compile columns where the bench and zoo extras are installed). A contender that is not
installed is n/a with a note.
"""


def write_results(path: Path, rows, notes, minfo, command, args, elapsed_s):
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {args.label or f'target={args.target}'}", ""]
    lines += [
        f"- Date: {date}; run took {elapsed_s:.0f} s",
        f"- Command: `{command}`",
        f"- apollo_py target: `{args.target}`; rounds: {args.rounds}; quick: {args.quick}",
        f"- Machine: {minfo['cpu']}, {minfo['cores']} cores; Python {minfo['python']}",
        f"- Versions: numpy {minfo['numpy']}, onnxruntime {minfo['onnxruntime']}, "
        + "".join(f"{k} {v}, " for k, v in minfo["others"].items())
        + f"apollo_py {minfo['apollo_py']} (git {minfo['git']}{minfo['dirty']})",
        f"- Threads: {args.threads} for every contender; {minfo['threads']}",
        f"- BLAS: {_blas_line(minfo['blas'])}",
        f"- Load average (1/5/15 min) at start: {minfo['loadavg_start']}, at end: {_loadavg()} "
        "(the machine is shared; other processes add noise)",
    ]
    if minfo["removed_env"]:
        lines.append("- `--native-blas`: removed " + ", ".join(f"{k}={v}" for k, v in
                                                                minfo["removed_env"].items())
                     + " from this benchmark process's environment before loading numpy")
    by = minfo["triad_by_threads"] or {}
    lines += [
        f"- Roofline at the start of the run: triad {minfo['triad_gbps']:.2f} GB/s "
        f"({minfo['triad_method']}, 3 x 64 MB arrays, best of "
        + ", ".join(f"{k} thread(s): {v:.2f}" for k, v in by.items())
        + f"); numpy sgemm {minfo['sgemm_n']}^3 float32 {minfo['sgemm_gflops']:.1f} GFLOP/s median "
        f"(best run {minfo['sgemm_best_gflops']:.1f})",
        "",
        "Times are median milliseconds per call (interleaved round-robin, after warm-up). "
        "Ratios use fresh-output times (OpenVINO's outputs are read in place); `best` is the fastest "
        "of onnxruntime-all, jax.jit and torch.compile in the row; `floor` = max(compulsory bytes / triad bandwidth, "
        "flops / sgemm rate), with the triad and sgemm medians sampled in the same round-robin "
        "as that row's contenders (the row's `triad GB/s` and `sgemm GFLOP/s`). `spread` = the "
        "worst (max-min)/median of any contender's samples in that row. Columns are explained "
        "in benchmarks/README.md.",
        "",
        markdown_table(rows),
        "",
    ]
    if notes:
        lines += ["Notes:", ""] + notes + [""]
    section = "\n".join(lines)
    if args.append and path.exists():
        path.write_text(path.read_text().rstrip("\n") + "\n\n" + section)
    else:
        path.write_text("# Benchmark results\n\n" + RESULTS_HOWTO + "\n" + section)


# --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(workloads.WORKLOADS),
                    help="run only these workloads (default: all)")
    ap.add_argument("--forms", choices=("both", *workloads.FORMS), default="both",
                    help="which forms of the workloads with exporter and decomposed forms (default both)")
    ap.add_argument("--threads", type=int, default=2,
                    help="threads for every contender (default 2; read before numpy loads)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    ap.add_argument("--target", default="cpu", help='apollo_py target (default "cpu")')
    ap.add_argument("--quick", action="store_true", help="small sizes, short samples (smoke run)")
    ap.add_argument("--write-results", action="store_true", help="rewrite benchmarks/RESULTS.md")
    ap.add_argument("--label", default="", help="the heading of this run's section in RESULTS.md")
    ap.add_argument("--append", action="store_true",
                    help="with --write-results: add this run as a new section instead of rewriting")
    ap.add_argument("--native-blas", action="store_true",
                    help="unset OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for this process only")
    ap.add_argument("--json", metavar="PATH", help="also dump raw results (all samples) as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.rounds < 5:
        print(f"note: --rounds {args.rounds} (< 5): medians are less robust", file=sys.stderr)

    started = time.perf_counter()
    threads = args.threads
    sample_s = 0.01 if args.quick else 0.05
    print("measuring roofline ...", flush=True)
    roof = roofline.Roofline.measure(quick=args.quick)
    minfo = machine_info(roof)
    probe = roofline.Probe(threads=roof.detail["triad_threads"])
    print(f"triad {roof.bw_gbps:.2f} GB/s, sgemm {roof.sgemm_gflops:.1f} GFLOP/s; "
          f"BLAS: {_blas_line(minfo['blas'])}", flush=True)

    names = args.only or list(workloads.WORKLOADS)
    rows_todo = [(n, f) for n in names for f in workloads.forms(n)
                 if args.forms == "both" or f in ("", args.forms)]
    results = []
    for name, form in rows_todo:
        w = workloads.build(name, quick=args.quick, form=form)
        print(f"\n== {w.name} {form} ({w.compulsory_bytes / 1e6:.1f} MB, {w.flops / 1e9:.3f} GFLOP)", flush=True)
        expected = _as_list(w.numpy_fn(**w.inputs))
        fns, info = build_contenders(w, expected, args.target, threads)
        na = {k: str(v) for k, v in fns.items() if isinstance(v, NA)}
        for k, why in na.items():
            print(f"   {k}: n/a — {why}", flush=True)
        if info["compile_s"] is not None:
            print(f"   apollo compile: jit {info['jit_s']:.3f} s, jit + first call {info['compile_s']:.3f} s",
                  flush=True)
        for k, v in info["contender_compile_s"].items():
            print(f"   {k} compile + first call: {v:.3f} s", flush=True)
        fns["roof:triad"], fns["roof:sgemm"] = probe.triad, probe.sgemm
        times = time_interleaved(fns, args.rounds, sample_s)
        local = probe.roofline(times.pop("roof:triad")["median_s"], times.pop("roof:sgemm")["median_s"])
        floor = local.floor_seconds(w.compulsory_bytes, w.flops)
        print(f"   roofline sampled with it: triad {local.bw_gbps:.2f} GB/s, "
              f"sgemm {local.sgemm_gflops:.1f} GFLOP/s -> floor {_ms(floor)} ms", flush=True)
        for k in CONTENDERS:
            if k in times:
                print(f"   {k:13s} {_ms(times[k]['median_s']):>9s} ms  (x{times[k]['reps']} per sample)", flush=True)
        results.append({"name": w.name, "key": name, "form": form, "floor_s": floor, "bytes": w.compulsory_bytes,
                        "flops": w.flops, "times": {k: times.get(k) for k in CONTENDERS},
                        "compile_s": info["compile_s"], "jit_s": info["jit_s"], "na": na,
                        "contender_compile_s": info["contender_compile_s"],
                        "notes": info["notes"], "triad_gbps": local.bw_gbps,
                        "sgemm_gflops": local.sgemm_gflops})
        del fns, w, expected
        gc.collect()

    elapsed = time.perf_counter() - started
    rows = table_rows(results)
    notes = notes_text(results)
    print("\n" + markdown_table(rows))
    if notes:
        print("\n" + "\n".join(notes))
    command = "python benchmarks/run.py" + ("" if not sys.argv[1:] else " " + shlex.join(sys.argv[1:]))
    if argv is not None:
        command = "python benchmarks/run.py " + shlex.join(argv)
    if args.write_results:
        write_results(HERE / "RESULTS.md", rows, notes, minfo, command, args, elapsed)
        print(f"\nwrote {HERE / 'RESULTS.md'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": minfo, "command": command, "results": results},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
