"""Command-line interface: ``apollo-py explain|run|cache|feedback|machine``.

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


def _cmd_explain(args, opts):
    from .api import explain
    plan = explain(args.model, options=opts)
    print(plan.to_json() if args.json else plan)


def _cmd_run(args, opts):
    import numpy as np
    from .api import jit
    f = jit(args.model, options=opts)
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
    p.add_argument("--target", default=None, help="cpu (default) | reference")
    p.add_argument("--cache-dir", default=None)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("explain", help="print the fusion plan of a model")
    e.add_argument("model")
    e.add_argument("--json", action="store_true")
    r = sub.add_parser("run", help="run a model on .npy inputs")
    r.add_argument("model")
    r.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    r.add_argument("--out", help="directory to write outputs as .npy")
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
    handlers = {"explain": _cmd_explain, "run": _cmd_run, "cache": _cmd_cache, "feedback": _cmd_feedback,
                "machine": _cmd_machine}
    try:
        opts = Options()
        if args.target:
            opts = opts.replace(target=args.target)     # OptionsError for a bad --target
        if args.cache_dir:
            opts = opts.replace(cache_dir=args.cache_dir)
        handlers[args.cmd](args, opts)
    except ApolloError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
