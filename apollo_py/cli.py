"""Command-line interface: ``apollo-py explain|run|compile|cache|feedback|machine``.

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


def _cmd_cache(args, opts):
    from .cache import PieceCache
    cache = PieceCache(opts.cache_dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {opts.cache_dir}")
    else:
        print(json.dumps(cache.info(), indent=1))


def _cmd_feedback(args, opts):
    from .feedback import report
    print(report.render(opts, html=args.html))


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
        m = M.measured_machine(opts.cache_dir, remeasure=args.measure)
    print(M.machine_json(m) if args.json else M.as_text(m))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="apollo-py", description="apollo_py fusion compiler")
    p.add_argument("--target", default=None, help="cpu (default) | reference | cuda | cuda-emu")
    p.add_argument("--cache-dir", default=None)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("explain", help="print the fusion plan of a model")
    e.add_argument("model")
    e.add_argument("--json", action="store_true")
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
    c = sub.add_parser("cache", help="inspect or clear the piecewise JIT cache")
    c.add_argument("action", choices=["info", "clear"])
    fb = sub.add_parser("feedback", help="rule-feedback reports")
    fb.add_argument("action", choices=["report"])
    fb.add_argument("--html", action="store_true")
    mc = sub.add_parser("machine", help="the machine figures the cost model uses, and where they came from")
    mc.add_argument("--measure", action="store_true", help="measure again (and store when plausible)")
    mc.add_argument("--reset", action="store_true", help="delete the stored figures first")
    mc.add_argument("--preset", help="show a preset instead (" + ", ".join(sorted(__import__(
        "apollo_py.machine", fromlist=["PRESETS"]).PRESETS)) + ")")
    mc.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    handlers = {"explain": _cmd_explain, "run": _cmd_run, "compile": _cmd_compile, "cache": _cmd_cache,
                "feedback": _cmd_feedback, "machine": _cmd_machine}
    try:
        opts = Options()
        target = getattr(args, "sub_target", None) or args.target
        if target:
            opts = opts.replace(target=target)          # OptionsError for a bad --target
        if args.cache_dir:
            opts = opts.replace(cache_dir=args.cache_dir)
        handlers[args.cmd](args, opts)
    except ApolloError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
