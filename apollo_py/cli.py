"""Command-line interface: ``apollo-py explain|run|compile|bench|tune|cache|feedback|machine``.

``feedback apply`` writes the refusals of the log into the rule overlay
``<cache-dir>/rules_overlay.toml`` (or ``--overlay``), which later compiles of this CLI read.

Errors the user can cause (bad model, bad input) print one line ``error: ...`` and exit 2 —
no traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import ApolloError
from .options import Options


def _load_inputs(pairs, compiled):
    import numpy as np
    feeds = {}
    for p in pairs or []:
        name, sep, path = p.partition("=")
        if not sep:
            raise ApolloError(f"--input expects NAME=FILE.npy, got {p!r}")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ApolloError(f"cannot read input {name!r} from {path!r}: {e}") from None
    return feeds


def parse_shapes(pairs) -> dict[str, tuple]:
    """``--shape NAME=D0,D1,...`` options as ``{name: (d0, d1, ...)}`` (``NAME=`` is rank 0)."""
    shapes: dict[str, tuple] = {}
    for p in pairs or []:
        name, sep, dims = p.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
            if any(d < 0 for d in shape):
                raise ValueError
        except ValueError:
            raise ApolloError(f"--shape expects NAME=D0,D1,... with dims >= 0, got {p!r}") from None
        if name in shapes:
            raise ApolloError(f"--shape gives input {name!r} twice")
        shapes[name] = shape
    return shapes


def _cmd_explain(args, opts):
    from .api import explain
    plan = explain(args.model, options=opts, input_shapes=parse_shapes(args.shape) or None)
    if args.html:
        if not hasattr(plan, "to_html"):
            raise ApolloError("--html draws one compiled plan; this model's plan is staged (a node's "
                              "output shape depends on data): use the text or --json")
        from .fsutil import atomic_write
        atomic_write(args.html, plan.to_html().encode())
        print(f"wrote {args.html} ({len(plan.kernels)} steps)")
        return
    print(plan.to_json() if args.json else plan)


def _cmd_run(args, opts):
    import numpy as np
    from .api import jit
    f = jit(args.model, options=opts, input_shapes=parse_shapes(args.shape) or None)
    outs = f.run(**_load_inputs(args.input, f))
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            raise ApolloError(f"--out {args.out!r}: cannot create the directory: {e}") from None
    for name, arr in zip(f.output_names, outs):
        if args.out:
            path = os.path.join(args.out, f"{name}.npy")
            try:
                np.save(path, arr)
            except OSError as e:
                raise ApolloError(f"cannot write output {name!r} to {path!r}: {e}") from None
            print(f"{name}: {arr.dtype}{list(arr.shape)} -> {path}")
        else:
            print(f"{name}: {arr.dtype}{list(arr.shape)}\n{arr}")


def _cmd_compile(args, opts):
    """Compile a model; for a CUDA target write each launch's .cu, .ptx per architecture,
    resource use (resources.json) and the plan (plan.json) under ``--out``, no GPU needed."""
    import os
    from .api import jit
    plan = jit(args.model, options=opts).plan
    if not args.out:
        print(plan)
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        f.write(plan.to_json())
    if not opts.target.startswith("cuda"):
        print(f"plan -> {args.out}/plan.json")
        return
    from .codegen.cached import piece_cache
    from .codegen.nvrtc import compile_cuda
    from .runtime.cuda import Launch
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    resources = {}
    for step in getattr(plan, "kernels", ()):
        if not isinstance(step, Launch):
            continue
        k = step.kernel
        with open(os.path.join(args.out, f"{k.name}.cu"), "w") as f:
            f.write(k.source)
        entry = {"form": k.form, "grid": list(k.grid), "block": list(k.block), "values": list(step.param_values)}
        for a in archs:
            b = compile_cuda(k.source, k.name, a, piece_cache(opts.cache_dir))
            with open(os.path.join(args.out, f"{k.name}.{a}.ptx"), "w") as f:
                f.write(b.ptx)
            entry[a] = b.resources[k.name].to_dict()
        resources[k.name] = entry
    with open(os.path.join(args.out, "resources.json"), "w") as f:
        json.dump(resources, f, indent=1)
    print(f"{len(resources)} CUDA kernels ({', '.join(archs)}) -> {args.out}")


def _bench_feeds(f, shapes, pairs, seed=0):
    """Inputs for ``bench``: the ``--input`` files, else random arrays of the given / static
    shapes (standard normal for floats, 0..9 for integers, random for bool)."""
    import numpy as np
    from .ir.types import DTYPES
    feeds = _load_inputs(pairs, f)
    rng = np.random.default_rng(seed)
    for spec in f.program.inputs:
        if spec.name in feeds:
            continue
        shape = shapes.get(spec.name) or spec.dims
        if not all(isinstance(d, int) for d in shape):
            raise ApolloError(f"input {spec.name!r} has symbolic shape {spec.describe()}: pass "
                              f"--shape {spec.name}=D0,D1,... or --input {spec.name}=FILE.npy")
        dt = np.dtype(DTYPES[spec.dtype])
        if dt.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            feeds[spec.name] = rng.integers(0, 10, size=shape).astype(dt)
    return feeds


def _ort_seconds(model, feeds, repeat):
    """Median seconds of onnxruntime on ``feeds`` (None when onnxruntime is not installed or
    the model is not an ONNX file or ModelProto)."""
    import statistics
    import time
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    src = model if isinstance(model, str) else getattr(model, "SerializeToString", lambda: None)()
    if src is None:
        return None
    try:
        sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
        want = {i.name for i in sess.get_inputs()}
        fd = {k: v for k, v in feeds.items() if k in want}
        sess.run(None, fd)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            sess.run(None, fd)
            times.append(time.perf_counter() - t0)
    except Exception as e:     # noqa: BLE001 -- onnxruntime's errors are its own; report, not fail
        print(f"onnxruntime: could not run the model ({str(e).splitlines()[0][:200]})")
        return None
    return statistics.median(times)


def _cmd_bench(args, opts):
    from .api import jit
    shapes = parse_shapes(args.shape)
    f = jit(args.model, options=opts, input_shapes=shapes or None)
    feeds = _bench_feeds(f, shapes, args.input)
    prof = f.profile(repeat=args.repeat, **feeds)
    print(json.dumps(prof.to_dict(), indent=1) if args.json else prof)
    ort_s = _ort_seconds(args.model, feeds, args.repeat)
    if ort_s is not None:
        print(f"onnxruntime: {ort_s * 1e3:.3f} ms per run (median of {args.repeat}); apollo_py / onnxruntime "
              f"= {prof.total_seconds / ort_s:.2f}x")


def _cmd_tune(args, opts):
    """Time candidate decisions per piece and store the winners (apollo_py/tuning/)."""
    from .tuning import tune
    shapes = parse_shapes(args.shape)
    feeds = None
    if args.input:
        from .api import jit
        feeds = _bench_feeds(jit(args.model, options=opts.replace(tune="off"), input_shapes=shapes or None),
                             shapes, args.input)
    if args.db:
        opts = opts.replace(tune_db=args.db)
    res = tune(args.model, options=opts, input_shapes=shapes or None, feeds=feeds, budget=args.budget,
               repeat=args.repeat, progress=None if args.progress is None else args.progress == "on",
               allow_load=args.allow_load)
    if args.json:
        print(json.dumps({"model": res.model, "default_s": res.default_s, "tuned_s": res.tuned_s, "db": res.db,
                          "rounds": res.rounds, "skipped": res.skipped, "records": res.records,
                          "load": res.load, "refused": res.refused}, indent=1))
        return
    print(res.summary())
    for k, r in sorted(res.records.items()):
        if r["decision"]:
            print(f"  {k}: {json.dumps(r['decision'])}  {r['default_s'] * 1e3:.4f} -> {r['tuned_s'] * 1e3:.4f} ms")


def _cmd_cache(args, opts):
    from .cache import PieceCache
    cache = PieceCache(opts.cache_dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {opts.cache_dir}")
    else:
        print(json.dumps(cache.info(), indent=1))


def default_overlay_path(opts) -> str:
    """The overlay ``feedback apply`` writes and compiles read unless ``--rules-overlay`` says."""
    import os
    return opts.rules_overlay or os.path.join(opts.cache_dir, "rules_overlay.toml")


def _cmd_feedback(args, opts):
    from .feedback import overlay as fa
    from .feedback import default_log_path, report
    overlay = args.overlay or default_overlay_path(opts)
    if args.action == "report":
        if args.version is not None:
            raise ApolloError("feedback report takes no VERSION")
        print(report.render(opts, html=args.html))
        return
    if args.action == "revert":
        if args.version is None:
            raise ApolloError(f"feedback revert needs a VERSION; revisions of {overlay} are "
                              f"{fa.revisions(overlay) or 'none'}")
        print(fa.revert(overlay, args.version))
        return
    log = args.log or default_log_path(opts)
    res = fa.apply(log, overlay, dry_run=args.dry_run)
    if not res.added:
        print(f"nothing to apply: every refused pattern in {log} is already in {overlay}")
        return
    print(res.diff, end="")
    if args.dry_run:
        print(f"dry run: {len(res.added)} entries would be added to {overlay}")
        return
    from .partition.rules import load_rules, split_signatures
    load_rules(overlay)                 # the written overlay must load (RuleError otherwise)
    split_signatures(overlay)
    print(f"{overlay}: revision {res.revision}, {len(res.added)} entries added "
          f"(compiles read it through --rules-overlay / Options(rules_overlay=...))")


def _cmd_machine(args, opts):
    import os
    from . import machine as M
    if args.reset:
        path = M.machine_path(opts.cache_dir)
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}")
    if args.preset:
        m = M.preset(args.preset)
    else:
        from .codegen.fma_peak import peak_probe
        m = M.measured_machine(opts.cache_dir, remeasure=args.measure, probe=peak_probe)
    print(M.machine_json(m) if args.json else M.as_text(m))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="apollo-py", description="apollo_py fusion compiler")
    p.add_argument("--target", default=None, help="cpu (default) | reference | cuda | cuda-emu")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--compile-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop a compile that runs longer (Options.compile_timeout)")
    p.add_argument("--rules-overlay", default=None,
                   help="rule overlay to compile with (default <cache-dir>/rules_overlay.toml when it exists)")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("explain", help="print the fusion plan of a model")
    e.add_argument("model")
    e.add_argument("--json", action="store_true")
    e.add_argument("--html", metavar="FILE", help="write the plan as one self-contained HTML page")
    e.add_argument("--shape", action="append", metavar="NAME=D0,D1,...",
                   help="shape of an input with symbolic dims (repeat per input)")
    r = sub.add_parser("run", help="run a model on .npy inputs")
    r.add_argument("model")
    r.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    r.add_argument("--out", help="directory to write outputs as .npy")
    r.add_argument("--shape", action="append", metavar="NAME=D0,D1,...",
                   help="pin the shape of an input with symbolic dims (the inputs must match)")
    co = sub.add_parser("compile", help="compile a model; with --out, write its kernels (CUDA: .cu, .ptx, "
                        "resources.json) and plan.json")
    co.add_argument("model")
    co.add_argument("--target", dest="sub_target", default=None, help="as the global --target")
    co.add_argument("--out", help="directory for the generated files")
    co.add_argument("--arch", default="sm_80,sm_90", help="CUDA architectures for the PTX (comma-separated)")
    bn = sub.add_parser("bench", help="profile a model: per-step times, GB/s, GFLOP/s, roofline; "
                                      "onnxruntime's time when installed")
    bn.add_argument("model")
    bn.add_argument("--shape", action="append", metavar="NAME=D0,D1,...",
                    help="shape of an input with symbolic dims (random inputs of these shapes)")
    bn.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="use this array for an input")
    bn.add_argument("--repeat", type=int, default=20)
    bn.add_argument("--json", action="store_true")
    tu = sub.add_parser("tune", help="time candidate decisions per piece (tiles, chunks, stitching, BLAS vs "
                                     "generated GEMM, layer-3 grouping) and store the winners for this machine")
    tu.add_argument("model")
    tu.add_argument("--shape", action="append", metavar="NAME=D0,D1,...",
                    help="shape of an input with symbolic dims (random inputs of these shapes)")
    tu.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="use this array for an input")
    tu.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="time budget for the model (default Options.tune_budget, 60 s)")
    tu.add_argument("--repeat", type=int, default=7, help="profiled runs per candidate round (medians)")
    tu.add_argument("--db", default=None, help="tuning database (default <cache-dir>/tuning.json)")
    tu.add_argument("--allow-load", action="store_true",
                    help="store the decisions even if other processes held the cores while timing "
                         "(refused by default: decisions follow the load they were timed under)")
    tu.add_argument("--progress", choices=["on", "off"], default=None,
                    help="progress bar on stderr (default: when stderr is a terminal)")
    tu.add_argument("--json", action="store_true")
    c = sub.add_parser("cache", help="inspect or clear the piecewise JIT cache")
    c.add_argument("action", choices=["info", "clear"])
    fb = sub.add_parser("feedback", help="rule-feedback reports")
    fb.add_argument("action", choices=["report", "apply", "revert"])
    fb.add_argument("version", nargs="?", type=int, metavar="VERSION", help="revert: the revision to restore")
    fb.add_argument("--html", action="store_true")
    fb.add_argument("--dry-run", action="store_true", help="apply: print the diff, write nothing")
    fb.add_argument("--log", help="apply: the feedback log (default <cache-dir>/feedback.jsonl)")
    fb.add_argument("--overlay", help="apply/revert: the overlay (default --rules-overlay, "
                                      "else <cache-dir>/rules_overlay.toml)")
    mc = sub.add_parser("machine", help="the machine figures the cost model uses, and where they came from")
    mc.add_argument("--measure", action="store_true", help="measure again (and store when plausible)")
    mc.add_argument("--reset", action="store_true", help="delete the stored figures first")
    mc.add_argument("--preset", help="show a preset instead (" + ", ".join(sorted(__import__(
        "apollo_py.machine", fromlist=["PRESETS"]).PRESETS)) + ")")
    mc.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    handlers = {"explain": _cmd_explain, "run": _cmd_run, "compile": _cmd_compile, "cache": _cmd_cache,
                "feedback": _cmd_feedback, "machine": _cmd_machine, "bench": _cmd_bench,
                "tune": _cmd_tune}
    try:
        opts = Options()
        target = getattr(args, "sub_target", None) or args.target
        if target:
            opts = opts.replace(target=target)          # OptionsError for a bad --target
        if args.cache_dir:
            opts = opts.replace(cache_dir=args.cache_dir)
        if args.compile_timeout is not None:
            opts = opts.replace(compile_timeout=args.compile_timeout)     # OptionsError if <= 0
        if args.rules_overlay:
            opts = opts.replace(rules_overlay=args.rules_overlay)
        elif args.cmd != "feedback" and os.path.exists(default_overlay_path(opts)):
            opts = opts.replace(rules_overlay=default_overlay_path(opts))   # what `feedback apply` wrote last
        handlers[args.cmd](args, opts)
    except ApolloError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
