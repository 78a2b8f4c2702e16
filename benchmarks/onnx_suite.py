"""The whole ONNX backend node suite through onnxruntime and apollo_py (both targets), one run.

    PYTHONPATH=. python benchmarks/onnx_suite.py [--only REGEX] [--markdown PATH] [--timeout 120]

Every node test that ships with the installed onnx (``onnx.backend.test.loader``, kind
"node": one model plus input/output data sets per case) runs through

* ``onnxruntime``: an ``InferenceSession`` on the CPU execution provider, all inputs fed at
  run time; no case is excluded;
* ``apollo_py`` with ``target="reference"`` and ``target="cpu"``, through the same backend
  wrapper as ``tests/frontend/test_onnx_backend.py`` (compile-time operands such as Reshape's
  shape are frozen into initializers; cases matching that file's EXCLUDE patterns are counted
  as excluded, with its reason).

Outputs are compared exactly as onnx's backend test runner does
(``Runner.assert_similar_outputs`` with each case's rtol/atol).  Prints, per op type, the
passed / failed / excluded counts of each contender and the totals, then every apollo failure
with its first error line; ``--markdown`` writes the same report as markdown
(benchmarks/ONNX_SUITE.md).  A case's op type is its model's single node type; ``_expanded``
cases count under the op they expand; other multi-node cases under their first node's type.
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import importlib.util
import os
import platform
import re
import signal
import sys
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("reference", "cpu")


def _load_backend_module():
    """tests/frontend/test_onnx_backend.py as a module (ApolloRep, EXCLUDE)."""
    path = os.path.join(ROOT, "tests", "frontend", "test_onnx_backend.py")
    spec = importlib.util.spec_from_file_location("apollo_onnx_backend_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = next((t for t in text if t.strip()), "")
    return f"{type(e).__name__}: {line}"[:160]


def run_case(case, make_rep, compare, timeout: int) -> str | None:
    """None if ``case`` passes with the backend ``make_rep(model)``, else the error line."""
    from onnx.backend.test.runner import _normalize_tensor
    signal.alarm(timeout)
    try:
        rep = make_rep(case.model)
        for inputs, ref_outputs in case.data_sets:
            ins = [_normalize_tensor(x) for x in inputs]
            refs = [_normalize_tensor(x) for x in ref_outputs]
            outs = rep.run(ins)
            compare(refs, list(outs), case.rtol, case.atol)
        return None
    except _Timeout:
        return f"timeout after {timeout} s"
    except BaseException as e:  # noqa: BLE001 - every failure is a counted result
        if isinstance(e, KeyboardInterrupt):
            raise
        return _first_line(e)
    finally:
        signal.alarm(0)


class OrtRep:
    """onnxruntime session over a ModelProto; ``run(list of arrays)`` in graph-input order."""

    def __init__(self, model):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.log_severity_level = 4
        self.sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        init = {t.name for t in model.graph.initializer}
        self.names = [vi.name for vi in model.graph.input if vi.name not in init]

    def run(self, inputs):
        return self.sess.run(None, {k: np.asarray(v) for k, v in zip(self.names, inputs)})


def op_of(case, by_name: dict) -> str:
    nodes = [n.op_type for n in case.model.graph.node]
    m = re.match(r"(.*?)_expanded(_ver\d+)?$", case.name)
    if m and m.group(1) in by_name:
        return op_of(by_name[m.group(1)], by_name)
    if len(nodes) == 1:
        return nodes[0]
    real = [t for t in nodes if t != "Constant"]
    return (real or nodes or ["(empty)"])[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="regex on test names")
    ap.add_argument("--markdown", help="write the report as markdown to this path")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per case and contender")
    ap.add_argument("--targets", default=",".join(TARGETS), help="apollo targets, comma-separated")
    ap.add_argument("--no-ort", action="store_true", help="leave onnxruntime out")
    ap.add_argument("--no-exclude", action="store_true",
                    help="run the cases apollo_py excludes too (to see whether they pass now)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    np.seterr(all="ignore")
    signal.signal(signal.SIGALRM, _alarm)

    import onnx
    import onnxruntime
    from onnx.backend.test.loader import load_model_tests
    from onnx.backend.test.runner import Runner

    import apollo_py
    bt = _load_backend_module()
    compare = Runner.assert_similar_outputs
    cases = sorted(load_model_tests(kind="node"), key=lambda c: c.name)
    if args.only:
        cases = [c for c in cases if re.search(args.only, c.name)]
    by_name = {c.name: c for c in cases}
    excl = [] if args.no_exclude else [(re.compile(p), why) for p, why in bt.EXCLUDE.items()]
    excl_cpu = [] if args.no_exclude else [(re.compile(p), why) for p, why in bt.EXCLUDE_CPU.items()]
    targets = [t for t in args.targets.split(",") if t]

    contenders = {} if args.no_ort else {"onnxruntime": OrtRep}
    for t in targets:
        contenders[f"apollo:{t}"] = (lambda t: lambda m: bt.ApolloRep(m, t))(t)
    # result[contender][case name] = "pass" | "excluded" | error line
    result = {k: {} for k in contenders}
    seconds = collections.Counter()
    reasons: dict = {}
    for i, c in enumerate(cases):
        why = next((w for p, w in excl if p.search(c.name) or p.search(c.name + "_cpu")), None)
        why_cpu = next((w for p, w in excl_cpu if p.search(c.name + "_cpu")), None)
        for k, make in contenders.items():
            w = why or (why_cpu if k == "apollo:cpu" else None)
            if w and k != "onnxruntime":
                result[k][c.name] = "excluded"
                reasons[(k if not why else "", c.name)] = w
                continue
            t0 = time.perf_counter()
            err = run_case(c, make, compare, args.timeout)
            seconds[k] += time.perf_counter() - t0
            result[k][c.name] = "pass" if err is None else err
        if (i + 1) % 200 == 0:
            print(f"... {i + 1}/{len(cases)}", file=sys.stderr, flush=True)

    ops = collections.defaultdict(list)
    for c in cases:
        ops[op_of(c, by_name)].append(c.name)

    def counts(k, names):
        r = [result[k][n] for n in names]
        p = sum(x == "pass" for x in r)
        e = sum(x == "excluded" for x in r)
        return p, len(r) - p - e, e

    head = "| op | cases | onnxruntime pass/fail | " + " | ".join(
        f"apollo {t} pass/fail/excl" for t in targets) + " |"
    lines = [
        "# ONNX backend node suite: onnxruntime vs apollo_py",
        "",
        f"Generated by `benchmarks/onnx_suite.py` on {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.node()} ({os.cpu_count()} cores); onnx {onnx.__version__}, onnxruntime "
        f"{onnxruntime.__version__}, numpy {np.__version__}.  {len(cases)} node test cases"
        + (f" matching `{args.only}`" if args.only else "") + ", all contenders in one process.",
        "",
        "onnxruntime runs every case; apollo_py counts the cases matching the EXCLUDE patterns of "
        "`tests/frontend/test_onnx_backend.py` as excluded (reasons below).  Seconds are the "
        "contender's total wall time over the suite (compile + run).",
        "",
        "## Totals",
        "",
        "| contender | passed | failed | excluded | seconds |",
        "|---|---|---|---|---|",
    ]
    all_names = [c.name for c in cases]
    for k in contenders:
        p, f, e = counts(k, all_names)
        lines.append(f"| {k} | {p} | {f} | {e} | {seconds[k]:.1f} |")
    kept = [n for n in all_names if ("", n) not in reasons]
    if "onnxruntime" in contenders:
        p_ort, f_ort, _ = counts("onnxruntime", kept)
        lines += ["", f"On the {len(kept)} cases apollo_py does not exclude, onnxruntime passes {p_ort} "
                      f"and fails {f_ort}.", ""]
    lines += ["## Per op type", "", head, "|---|---|---|" + "---|" * len(targets)]
    for op in sorted(ops, key=str.lower):
        names = ops[op]
        po, fo, _ = counts("onnxruntime", names) if "onnxruntime" in contenders else ("-", "-", 0)
        cells = []
        for t in targets:
            p, f, e = counts(f"apollo:{t}", names)
            cells.append(f"{p}/{f}/{e}")
        lines.append(f"| {op} | {len(names)} | {po}/{fo} | " + " | ".join(cells) + " |")

    lines += ["", "## Exclusion reasons (apollo_py)", ""]
    by_reason = collections.Counter((k, w) for (k, _), w in reasons.items())
    for (k, why), n in by_reason.most_common():
        lines.append(f"* {n} cases{' (' + k + ' only)' if k else ''}: {why}")

    for k in contenders:
        fails = [(n, result[k][n]) for n in all_names if result[k][n] not in ("pass", "excluded")]
        lines += ["", f"## Failures: {k} ({len(fails)})", ""]
        grouped = collections.defaultdict(list)
        for n, err in fails:
            grouped[re.sub(r"'[^']*'|\d+", "_", err)[:150]].append((n, err))
        for key, items in sorted(grouped.items(), key=lambda kv: -len(kv[1])):
            names = ", ".join(n for n, _ in items[:12]) + (f", ... (+{len(items) - 12})" if len(items) > 12 else "")
            lines.append(f"* {len(items)} × `{items[0][1]}`: {names}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
