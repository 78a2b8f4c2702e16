"""The auto-tuner: times candidate decisions per piece on the real shapes, stores the winners.

:func:`tune_graph` compiles a static graph with sets of candidate decisions and profiles each
compile on inputs of the real shapes (runtime/profile.py: per-dispatch medians).  Candidates are
tried in *rounds*: one round applies one candidate to every piece it concerns at once (e.g. "no
stitch" to every layer-2 stitch group, "tiles (16,)" to every kernel group) and each piece's
time is read from the profile, so a round costs one compile and ``repeat`` runs whatever the
number of pieces.  Pieces and where their time is read:

* ``stitch:`` a layer-2 stitch group of several micro-graphs: stitched or not (``{"stitch":
  false}``); its time is that of the steps computing its micro-graphs;
* ``group:`` a lowering group (what layers 2/1 lower as one unit): BLAS vs generated GEMM
  (``{"gemm": ...}``, float32 matmul groups) and layer-1 tile sizes (``{"tiles": [...]}``);
* ``kernel:`` a generated kernel with a parallel loop: how many chunks it is cut into
  (``{"parts": n}``; 1 = on the calling thread);
* ``run:`` a run of independent kernels: layer 3's grouping or each on its own
  (``{"layer3": "separate"}``).

A piece takes a candidate only when it is at least ``MIN_GAIN`` faster than its best so far (the
box may be shared: small differences are noise), and only from a round whose whole run is not
``MIN_GAIN`` slower than the last reference round's (a piece can win by slowing the others
down: OpenBLAS's threads spin after a BLAS call and take the cores from the next kernels).  Pieces with the same key (the same block in
every layer) share one decision and their times add up.  After the rounds a final compile with
every decision is timed against the first (no decisions) one, and the two executables are run
interleaved (whole runs, median of 5 rounds): when the tuned one is not faster as a whole
(a piece's win was noise, or pieces interfere), every decision is dropped and the defaults
are stored instead.  The decisions go to the tuning
database (tuning/db.py); each piece's measured, default and predicted (cost model) times to the
feedback log as ``tuning_result`` events; the median ``measured / predicted`` per step kind to
``cost_corrections.json``, which layer 3's cost model reads from then on.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..errors import ApolloError
from ..options import Options
from . import db, load
from .convs import CONV_ROUNDS, direct_candidates
from .kernels import kernel_code_candidates
from .space import GEMM_ROUNDS, gemm_candidates, rows_candidates

#: a candidate must beat the piece's best time by this fraction to replace it
MIN_GAIN = 0.05
#: a round whose whole run is this fraction slower than its reference's is not used
SLOWER_ROUND = 0.05
#: tile sizes tried for the outer band of every layer-1 kernel group
TILE_CANDIDATES = ((16,), (64,), (8, 64))
#: chunk counts tried for every parallel kernel
PARTS_CANDIDATES = (1, 2, 4)
#: code candidates of layer-1 kernels (tuning/kernels.py), in this order
KERNEL_ROUNDS = ("vector 256", "parallel dim 1")
#: whether a generated GEMM may be flipped to BLAS (BLAS -> generated is always tried).  It was
#: off: on the shared 2-core box DLRM's two flipped GEMMs measured faster in the tuner's process
#: (55 vs 68 us), while in a process that also ran generated GEMMs on apollo's pool each
#: OpenBLAS call took 135-210 ms (its threads spin and yield; load 15), the model 40x slower.
#: Since then every run of a plan with BLAS steps holds OpenBLAS at one thread
#: (runtime/blas.py: OneBlasThread), so the tuner's runs and later ones see the same BLAS, and a
#: flip must also survive a "blas confirm" round (piece and whole run, paired)
TRY_BLAS = True


@dataclass
class TuneResult:
    """What :func:`tune_graph` did: whole-run medians without decisions (``default_s``) and
    with the chosen ones (``tuned_s``), the records stored per piece, the rounds run (name,
    seconds) and those the budget left out, the database path and the tuned plan's steps."""

    model: str
    default_s: float
    tuned_s: float
    records: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    db: str = ""
    plan_steps: list = field(default_factory=list)
    confirm_ratio: float | None = None      # default / tuned whole-run time, interleaved (> 1: faster)
    rejected: dict = field(default_factory=dict)    # decisions dropped: not confirmed, or the whole was not faster
    slower_rounds: list = field(default_factory=list)   # rounds whose whole run was slower: not used
    load: dict = field(default_factory=dict)    # what other processes took while it timed (tuning/load.py)
    refused: str = ""       # why no decision was stored (the machine was busy), "" when stored

    @property
    def changed(self) -> dict:
        """Piece key -> decision for the pieces whose decision is not the compiler's default."""
        return {k: r["decision"] for k, r in self.records.items() if r["decision"]}

    def summary(self) -> str:
        kinds: dict = {}
        for r in self.records.values():
            kinds.setdefault(r["kind"], [0, 0])
            kinds[r["kind"]][0] += 1
            kinds[r["kind"]][1] += bool(r["decision"])
        what = ", ".join(f"{k}: {n} ({c} changed)" for k, (n, c) in sorted(kinds.items()))
        return (f"tuned {self.model}: {self.default_s * 1e3:.3f} ms -> {self.tuned_s * 1e3:.3f} ms per run "
                f"({self.default_s / self.tuned_s if self.tuned_s else 0:.2f}x"
                + (f"; interleaved check {self.confirm_ratio:.2f}x" if self.confirm_ratio else "")
                + (f", {len(self.rejected)} decisions dropped" if self.rejected else "")
                + f"); pieces {what or 'none'}; "
                + (f"NOT STORED: {self.refused}; " if self.refused else "")
                + f"{len(self.rounds)} rounds" + (f", skipped (budget): {', '.join(self.skipped)}" if self.skipped
                                                 else "") + f"; decisions in {self.db}")


class _Measurement:
    """One compile with a set of decisions, profiled: per-step seconds and the pieces it has."""

    def __init__(self, exe, prof, options):
        from ..layers.lowering import lowering_groups, stitch_key
        from ..layers.layer2 import stitch_groups
        self.exe, self.prof, self.total = exe, prof, prof.total_seconds
        plan = exe.plan
        self.graph, self.mgs = plan.graph, plan.micro_graphs
        types = self.graph.types
        self.step_s = [0.0] * len(exe.steps)
        for d in prof.steps:        # a layer-3 group's time is shared by its members' bytes
            w = [max(1, getattr(getattr(exe.steps[i], "fused", None), "bytes", 1)) for i in d.steps]
            for i, wi in zip(d.steps, w):
                self.step_s[i] += d.seconds * wi / sum(w)
        self.step_mgs = [set(getattr(s, "micro_graphs", ()) or ()) for s in plan.kernels]
        tuned = db.decisions(options)
        groups, _, keys = lowering_groups(self.graph, self.mgs, options, tuned, with_keys=True)
        self.groups = dict(zip(keys, groups))
        self.stitches = {stitch_key(g, self.mgs, types): g for g in stitch_groups(self.mgs, types) if len(g) > 1}
        from ..runtime.cpu import KernelStep
        self.kernels: dict[str, list[int]] = {}
        self.all_kernels: dict[str, list[int]] = {}     # every layer-1 kernel (code decisions)
        self.fused: dict[str, object] = {}
        for i, s in enumerate(exe.steps):
            if isinstance(s, KernelStep) and s.fused is not None:
                k = db.kernel_key(s.fused, types)
                self.all_kernels.setdefault(k, []).append(i)
                self.fused.setdefault(k, s.fused)
                if (s.compiled.parallel_extent or 0) > 1:
                    self.kernels.setdefault(k, []).append(i)
        index = self._index = {id(s): i for i, s in enumerate(exe.steps)}
        keyed = {id(s): db.kernel_key(s.fused, types) for s in exe.steps if isinstance(s, KernelStep)}
        self.runs: dict[str, list[int]] = {}
        for run in exe.runs:
            self.runs.setdefault(db.run_key([keyed[id(s)] for s in run]), []).extend(index[id(s)] for s in run)
        # generated GEMMs and implicit-GEMM convs (a direct conv or fused attention has no Blocking)
        from ..runtime.gemm_step import gemm_key
        self.gemms: dict[str, list[int]] = {}
        self.gemm_descs: dict[str, object] = {}
        self.rows: set = set()
        for i, s in enumerate(exe.steps):
            cg = getattr(s, "compiled", None)
            # (a channel-vector conv, codegen/conv_cvec.py, has a CvecBlocking the tuner does not
            # search yet: no gemm: piece, rather than rounds that time unchanged code)
            if (type(s).__name__ == "GemmStep" and getattr(cg, "blocking", None) is not None
                    and type(cg).__name__ != "CompiledConvCvec"):
                k = gemm_key(cg.desc)
                self.gemms.setdefault(k, []).append(i)
                self.gemm_descs[k] = cg.desc
                if type(cg).__name__ == "CompiledConvRows":     # its own candidates (space.rows_candidates)
                    self.rows.add(k)
        # direct convs (tuning/convs.py)
        from .convs import direct_key
        self.dconvs: dict[str, list[int]] = {}
        self.dconv_of: dict[str, object] = {}
        for i, s in enumerate(exe.steps):
            cg = getattr(s, "compiled", None)
            if type(cg).__name__ == "CompiledDirectConv":
                k = direct_key(cg.desc)
                self.dconvs.setdefault(k, []).append(i)
                self.dconv_of.setdefault(k, cg)

    def run_steps(self, feeds) -> list[float]:
        """One traced run: seconds per step (a layer-3 group's time shared as in ``step_s``)."""
        exe = self.exe
        trace: list = []
        exe.trace = trace
        try:
            exe.run(feeds)
        finally:
            exe.trace = None
        out = [0.0] * len(exe.steps)
        for k, sec in trace:
            kind, item = exe._schedule[k]
            members = item if kind == "kernels" else [item]
            idx = [self._index[id(s)] for s in members]
            w = [max(1, getattr(getattr(s, "fused", None), "bytes", 1)) for s in members]
            for i, wi in zip(idx, w):
                out[i] += sec * wi / sum(w)
        return out

    def paired(self, ref: "_Measurement", feeds, runs: int) -> None:
        """Runs this executable and ``ref``'s alternately (``runs`` each, the order swapped
        every pair): :meth:`pair_ratio` then compares pieces under the same load, which on a
        shared box drifts by 2x within seconds -- more than any candidate's effect."""
        self.ref, self.pairs = ref, []
        for r in range(runs):
            if r % 2:
                mine = self.run_steps(feeds)
                self.pairs.append((ref.run_steps(feeds), mine))
            else:
                theirs = ref.run_steps(feeds)
                self.pairs.append((theirs, self.run_steps(feeds)))

    def pair_ratio(self, ref_idx, idx) -> float:
        """Median over the paired runs of (this run's seconds in steps ``idx``) / (the
        reference's in ``ref_idx``); ``("mgs", set)`` instead of indices: the steps computing
        those micro-graphs (:meth:`mg_time`)."""
        def secs(m, sel, ss):
            return m.mg_time(sel[1], ss) if isinstance(sel, tuple) else sum(ss[i] for i in sel)
        return statistics.median(secs(self, idx, mine) / max(1e-12, secs(self.ref, ref_idx, theirs))
                                 for theirs, mine in self.pairs)

    def mg_time(self, mgs, step_s=None) -> float:
        """Seconds of the steps computing micro-graphs ``mgs`` (a step computing others too
        counts by the share of its micro-graphs in ``mgs``); ``step_s``: one run's (default:
        the profile's medians)."""
        mgs = set(mgs)
        return sum(t * len(m & mgs) / len(m) for t, m in zip(self.step_s if step_s is None else step_s,
                                                             self.step_mgs) if m & mgs)

    def steps_time(self, idx) -> float:
        return sum(self.step_s[i] for i in idx)

    def predicted(self, mgs) -> float:
        """The cost model's seconds for the steps computing ``mgs`` (bytes, flops of the profile)."""
        m = self.exe.machine
        mgs = set(mgs)
        out = 0.0
        for d in self.prof.steps:
            share = [len(self.step_mgs[i] & mgs) / max(1, len(self.step_mgs[i])) for i in d.steps]
            if any(share):
                out += m.cost(d.bytes, d.flops) * sum(share) / len(share)
        return out

    def predicted_steps(self, idx) -> float:
        """The cost model's seconds for steps ``idx`` (a dispatch running others too counts by
        the share of its steps in ``idx``)."""
        m = self.exe.machine
        idx = set(idx)
        return sum(m.cost(d.bytes, d.flops) * len(idx & set(d.steps)) / len(d.steps)
                   for d in self.prof.steps if idx & set(d.steps))

    def group_uses_gemm(self, g) -> str | None:
        """"generated" / "blas" for a group holding a float32 matmul on the CPU, else None."""
        nodes = [n for k in g for n in self.mgs[k].nodes]
        heads = [n for n in nodes if n.op == "matmul"]
        types = self.graph.types
        if len(heads) != 1 or any(types[v].dtype != "float32" for v in (*heads[0].inputs, *heads[0].outputs)):
            return None
        gen = any(getattr(s, "gemm", None) is not None and self.step_mgs[i] & set(g)
                  for i, s in enumerate(self.exe.plan.kernels))
        return "generated" if gen else "blas"


def graph_for(program, shapes: Mapping[str, tuple], options: Options):
    """The static primitive graph of ``program`` at ``shapes`` (what compile_graph compiles)."""
    lower = getattr(program, "lower", None)
    if lower is None:
        return program.specialize(shapes)
    try:
        lowered = lower(shapes, options)
    except TypeError:
        raise ApolloError(f"{type(program).__name__}: tuning needs an ONNX model or a Graph") from None
    if getattr(lowered, "split", None) is not None:
        raise ApolloError(f"cannot tune {program.name!r}: node {lowered.split.name!r} has a data-dependent "
                          f"output shape ({lowered.split_reason}), so the model has no single static plan")
    return getattr(lowered, "graph", lowered)


def random_feeds(graph, seed: int = 0) -> dict:
    """Inputs of the graph's real shapes: standard normal floats, integers in 0..9, random bools."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        t = graph.types[v]
        dt = np.dtype(t.np_dtype)
        if dt.kind == "f":
            feeds[v] = rng.standard_normal(t.shape).astype(dt)
        elif dt.kind == "b":
            feeds[v] = rng.random(t.shape) < 0.5
        else:
            feeds[v] = rng.integers(0, 10, size=t.shape).astype(dt)
    return feeds


def _bar(total: int, what: str, enabled):
    if enabled is False:
        return None
    from tqdm import tqdm
    import sys
    if enabled is None and not sys.stderr.isatty():
        return None
    return tqdm(total=total, desc=f"apollo_py: tuning {what}", file=sys.stderr, leave=False, dynamic_ncols=True)


def tune_graph(graph, options: Options, feeds: Mapping | None = None, *, budget: float | None = None,
               repeat: int = 7, progress: bool | None = None,
               on_round: Callable[[str, int], None] | None = None, allow_load: bool = False) -> TuneResult:
    """Tune ``graph`` (static shapes) on ``feeds`` (default: :func:`random_feeds`) and store the
    decisions in ``options``' tuning database for this machine; see the module docs.

    ``budget``: seconds (default ``options.tune_budget``); a round starts only while the time
    spent plus the previous round's time is within it (the first and the final measurement
    always run, so a tuning may overrun its budget by about one round).  ``repeat``: profiled runs per
    round (medians).  ``progress``: a tqdm bar on stderr (None: only on a terminal).
    ``on_round(name, pieces)`` is called before each round.  ``allow_load``: store the
    decisions even when other processes took more than ``load.MAX_OTHERS_SHARE`` of the cores
    while it timed (by default they are refused with a warning, and the pieces are stored with
    the compiler's defaults, so ``Options(tune="tune")`` does not tune again at every call).
    Every record carries the load it was timed under (``"load"``).  Returns a :class:`TuneResult`.
    """
    if options.target != "cpu":
        raise ApolloError(f"tuning times CPU kernels; Options.target is {options.target!r}")
    from ..compiler import compile_graph
    from ..runtime.profile import profile_executable
    budget = options.tune_budget if budget is None else budget
    feeds = dict(feeds) if feeds is not None else random_feeds(graph)
    t_start = time.perf_counter()
    window = load.start()
    tmpdir = tempfile.mkdtemp(prefix="apollo_py_tune_")
    cand_db = os.path.join(tmpdir, "candidates.json")
    name = options.model_name or graph.name or "model"

    def measure(decisions: dict, runs: int) -> _Measurement:
        if os.path.exists(cand_db):
            os.remove(cand_db)
        db.write(cand_db, {k: {"kind": k.split(":")[0], "decision": d} for k, d in decisions.items() if d})
        opts = options.replace(tune="replay", tune_db=cand_db, progress=False)
        exe = compile_graph(graph, opts)
        exe.use_driver = True
        return _Measurement(exe, profile_executable(exe, feeds, repeat=runs, warmup=1), opts)

    best: dict[str, dict] = {}          # piece key -> decision ({} = the compiler's default)
    best_s: dict[str, float] = {}
    default_s: dict[str, float] = {}
    cands: dict[str, dict] = {}
    kinds: dict[str, str] = {}
    result = TuneResult(model=name, default_s=0.0, tuned_s=0.0, db=db.db_path(options))
    n_rounds = 10 + len(KERNEL_ROUNDS) + len(CONV_ROUNDS) + len(TILE_CANDIDATES) + len(PARTS_CANDIDATES) + len(GEMM_ROUNDS)
    bar = _bar(n_rounds, name, progress if progress is not None
               else options.progress)
    last_round = [0.0]
    ref_total = [float("inf")]     # whole-run time of the last reference round

    def run_round(label: str, decisions: dict, pieces: int, ref: _Measurement | None = None,
                  whole: bool = True) -> _Measurement | None:
        """Compile and profile with ``decisions``; with ``ref``, also run against ``ref``'s
        executable alternately (:meth:`_Measurement.paired`): pieces are then compared by
        paired ratios, and so is the whole run (``whole``: a round whose whole run is slower
        than ``ref``'s is not used)."""
        elapsed = time.perf_counter() - t_start
        if label not in ("default", "final", "gemm confirm", "blas confirm") and elapsed + last_round[0] > budget:
            result.skipped.append(label)
            return None
        if on_round:
            on_round(label, pieces)
        if bar is not None:
            bar.set_postfix_str(f"{label}: {pieces} pieces")
        t0 = time.perf_counter()
        # a paired round's pieces are read from the pairs: its own profile is one run (for the
        # dispatch list and the round's log line)
        m = measure(decisions, repeat if ref is None else 1)
        if ref is not None:
            m.paired(ref, feeds, max(3, repeat))
        # the estimate of the next round: this one's time (not the first's, which compiled
        # everything cold and measured the machine)
        last_round[0] = 0.0 if label == "default" else time.perf_counter() - t0
        result.rounds.append((label, round(last_round[0], 3), round(m.total * 1e3, 3)))
        if bar is not None:
            bar.update(1)
        if label in ("default", "rebaseline", "final"):
            ref_total[0] = m.total
        elif whole and (m.pair_ratio(range(len(ref.exe.steps)), range(len(m.exe.steps))) if ref is not None
                        else m.total / ref_total[0]) > 1 + SLOWER_ROUND:
            # the round is slower as a whole: a piece's own time may have improved while it
            # slowed the others down (OpenBLAS threads spinning after a BLAS call), so no piece
            # takes this round's candidate
            result.slower_rounds.append(label)
            return None
        return m

    def note(key: str, kind: str, label: str, seconds: float, decision: dict, base: float | None = None):
        """Record candidate ``label``'s time for ``key``; keep ``decision`` if it wins."""
        kinds[key] = kind
        cands.setdefault(key, {})[label] = round(seconds, 9)
        if key not in best_s:
            best_s[key] = default_s[key] = base if base is not None else seconds
            best[key] = {}
        if label != "default" and seconds < best_s[key] * (1 - MIN_GAIN):
            best_s[key] = seconds
            best[key] = decision

    def decided() -> dict:
        return {k: d for k, d in best.items() if d}

    try:
        m0 = run_round("default", {}, 0)
        result.default_s = m0.total
        # layer 2: every stitch group unstitched at once
        for k, g in m0.stitches.items():
            note(k, "stitch", "default", m0.mg_time(g), {})
        if m0.stitches:
            m = run_round("stitch off", {k: {"stitch": False} for k in m0.stitches}, len(m0.stitches), ref=m0)
            if m is not None:
                for k, g in m0.stitches.items():
                    note(k, "stitch", "stitch off", default_s[k] * m.pair_ratio(("mgs", g), ("mgs", g)),
                         {"stitch": False})
        base = run_round("rebaseline", decided(), 0) if decided() else m0
        base = base or m0
        groups = dict(base.groups)
        for k, g in groups.items():
            note(k, "group", "default", base.mg_time(g), {})
        # BLAS vs generated GEMM, per float32 matmul group
        flips = {k: {"gemm": "blas" if base.group_uses_gemm(g) == "generated" else "generated"}
                 for k, g in groups.items() if base.group_uses_gemm(g) == "blas"
                 or (TRY_BLAS and base.group_uses_gemm(g) == "generated")}
        if flips:
            m = run_round("gemm flip", {**decided(), **flips}, len(flips), ref=base)
            if m is not None:
                for k, d in flips.items():
                    g = ("mgs", groups[k])
                    note(k, "group", f"gemm={d['gemm']}", default_s[k] * m.pair_ratio(g, g), dict(d))
            # a generated -> BLAS flip is kept only if a second paired round of every decision so
            # far finds the piece still MIN_GAIN faster *and* the whole run not slower: BLAS's
            # cost depends on what else the process runs (OpenBLAS's threads beside the pool;
            # runs hold it at one thread since runtime/blas.py's OneBlasThread)
            to_blas = [k for k, d in flips.items() if d["gemm"] == "blas" and best.get(k)]
            if to_blas:
                m = run_round("blas confirm", decided(), len(to_blas), ref=base)
                for k in to_blas:
                    g = ("mgs", groups[k])
                    r = m.pair_ratio(g, g) if m is not None else 1.0
                    cands[k]["blas confirm"] = round(default_s[k] * r, 9)
                    if r > 1 - MIN_GAIN:
                        result.rejected[k] = best[k]
                        best[k], best_s[k] = {}, default_s[k]
        # generated GEMM / implicit-GEMM conv: blocking, tile split, threads (tuning/space.py)
        gbase = run_round("rebaseline", decided(), 0) if decided() else base
        gbase = gbase or base
        for k, idx in gbase.gemms.items():
            note(k, "gemm", "default", gbase.steps_time(idx), {})
        threads = int(options.num_threads or os.cpu_count() or 1)
        focus = _heaviest({k: default_s[k] for k in gbase.gemms}, gbase.total)
        for label in GEMM_ROUNDS if focus else ():
            cand = {}
            for k in focus:
                d = gbase.gemm_descs[k]
                c = (rows_candidates if k in gbase.rows else gemm_candidates)(d, best.get(k, {}), threads).get(label)
                if c is not None:
                    cand[k] = c
            if not cand:
                continue
            # GEMMs run one after another on the pool (no BLAS threads left spinning): a piece's
            # candidate does not slow the others, so a round may keep its winners while others lose
            m = run_round(f"gemm {label}", {**decided(), **cand}, len(cand), ref=gbase, whole=False)
            if m is not None:
                for k in cand:
                    if k in m.gemms:
                        note(k, "gemm", f"gemm {label}", default_s[k] * m.pair_ratio(gbase.gemms[k], m.gemms[k]),
                             cand[k])
        # a second, paired look at every GEMM decision together: one round's win on a loaded box
        # may be noise (measured: single-round ratios spread 0.2-11 at load 14), so a piece keeps
        # its decision only if it is still MIN_GAIN faster than the default here
        won = [k for k in gbase.gemms if best.get(k)]
        if won:
            m = run_round("gemm confirm", decided(), len(won), ref=gbase, whole=False)
            for k in won:
                r = m.pair_ratio(gbase.gemms[k], m.gemms[k]) if m is not None and k in m.gemms else 1.0
                cands[k]["gemm confirm"] = round(default_s[k] * r, 9)
                if r > 1 - MIN_GAIN:
                    result.rejected[k] = best[k]
                    best[k], best_s[k] = {}, default_s[k]
        # layer-1 tile sizes, per group with a generated kernel (on top of its gemm decision)
        # (after the GEMM rounds, timed against a plan with every decision so far: a matmul
        # group's GEMM decision is not credited to its tiles)
        tbase = run_round("rebaseline", decided(), 0) if decided() else base
        tbase = tbase or base
        tiled = [k for k, g in groups.items() if any(getattr(s, "fused", None) is not None and base.step_mgs[i] & set(g)
                                                      for i, s in enumerate(base.exe.plan.kernels))]
        tref = dict(best_s)     # each piece's time in tbase's plan
        for tiles in TILE_CANDIDATES:
            cand = {k: {**best.get(k, {}), "tiles": list(tiles)} for k in tiled}
            m = run_round(f"tiles {tiles}", {**decided(), **cand}, len(cand), ref=tbase)
            if m is not None:
                for k in tiled:
                    if k in m.groups:
                        g = ("mgs", groups[k])
                        note(k, "group", f"tiles={list(tiles)}", tref[k] * m.pair_ratio(g, g), cand[k])
        base = run_round("rebaseline", decided(), 0) or base
        # layer-1 kernels' code: vector width, parallel dim (tuning/kernels.py), heaviest first
        kref = {k: base.steps_time(idx) for k, idx in base.all_kernels.items()}
        for k in kref:
            note(k, "kernel", "default", kref[k], {})
        kfocus = _heaviest(kref, base.total)
        kbase = base
        for label in KERNEL_ROUNDS:
            cand = {}
            for k in kfocus:
                c = kernel_code_candidates(kbase.fused[k]).get(label)
                if c is not None:
                    cand[k] = {**best.get(k, {}), **c}
            if not cand:
                continue
            m = run_round(label, {**decided(), **cand}, len(cand), ref=kbase)
            if m is not None:
                for k in cand:
                    if k in m.all_kernels:
                        note(k, "kernel", label, kref[k] * m.pair_ratio(kbase.all_kernels[k], m.all_kernels[k]),
                             cand[k])
        # direct convs: flat or row form, threads (tuning/convs.py), heaviest first
        cref = {k: base.steps_time(idx) for k, idx in base.dconvs.items()}
        for k in cref:
            note(k, "conv", "default", cref[k], {})
        cfocus = _heaviest(cref, base.total)
        for label in CONV_ROUNDS:
            cand = {}
            for k in cfocus:
                cg = kbase.dconv_of[k]
                c = direct_candidates(cg.desc, best.get(k, {}), bool(cg.inline), threads).get(label)
                if c is not None:
                    cand[k] = c
            if not cand:
                continue
            m = run_round(label, {**decided(), **cand}, len(cand), ref=kbase)
            if m is not None:
                for k in cand:
                    if k in m.dconvs:
                        note(k, "conv", label, cref[k] * m.pair_ratio(kbase.dconvs[k], m.dconvs[k]), cand[k])
        # recalibrate the cost model before the runtime rounds, so that layer 3's groups in
        # them (and in every later compile) are the ones the corrected model makes
        _recalibrate(options, base)
        base = run_round("rebaseline", decided(), 0) or base
        # runtime: chunks per parallel kernel, then layer 3's grouping per run
        for k, idx in base.kernels.items():
            note(k, "kernel", "default", base.steps_time(idx), {})
        pref = {k: best_s[k] for k in base.kernels}     # each piece's time in base's plan
        for p in PARTS_CANDIDATES:
            cand = {k: {**best.get(k, {}), "parts": p} for k in base.kernels}
            if not cand:
                break
            m = run_round(f"parts {p}", {**decided(), **cand}, len(cand), ref=base)
            if m is not None:
                for k in base.kernels:
                    if k in m.kernels:
                        note(k, "kernel", f"parts={p}", pref[k] * m.pair_ratio(base.kernels[k], m.kernels[k]),
                             cand[k])
        for k, idx in base.runs.items():
            note(k, "run", "default", base.steps_time(idx), {})
        if base.runs:
            m = run_round("layer3 separate", {**decided(), **{k: {"layer3": "separate"} for k in base.runs}},
                          len(base.runs), ref=base)
            if m is not None:
                for k in base.runs:
                    if k in m.runs:
                        note(k, "run", "layer3 separate", default_s[k] * m.pair_ratio(base.runs[k], m.runs[k]),
                             {"layer3": "separate"})
        final = run_round("final", decided(), 0)
        if decided():
            # confirmation: the default and the tuned executables interleaved, whole runs; a
            # tuned plan that is not faster as a whole (noise won a piece) is not kept
            result.confirm_ratio = _ab_ratio(m0.exe, final.exe, feeds, rounds=5, reps=max(3, repeat))
            if result.confirm_ratio < 1.0:
                result.rejected.update(decided())
                best = {k: {} for k in best}
                best_s.update(default_s)
                final = run_round("final", {}, 0)
        result.load = window.stop()
        refused = "" if allow_load else load.too_busy(result.load)
        if refused:
            # decisions follow the load they were timed under: store none of them
            import warnings
            warnings.warn(f"apollo_py tune {name}: {refused}", RuntimeWarning, stacklevel=2)
            result.refused = refused
            result.rejected.update(decided())
            best = {k: {} for k in best}
            best_s.update(default_s)
            final = m0
    finally:
        if bar is not None:
            bar.close()
        try:
            if os.path.exists(cand_db):
                os.remove(cand_db)
            os.rmdir(tmpdir)
        except OSError:
            pass
    result.tuned_s = final.total
    result.plan_steps = plan_steps(final.exe)
    date = db.stamp()
    for k in best:
        mgs = groups.get(k) or m0.stitches.get(k)
        idx = final.all_kernels.get(k) or final.runs.get(k) or final.gemms.get(k) or final.dconvs.get(k)
        pred = final.predicted(mgs) if mgs else final.predicted_steps(idx) if idx else None
        result.records[k] = {"kind": kinds[k], "decision": best[k], "tuned_s": round(best_s[k], 9),
                             "default_s": round(default_s[k], 9), "candidates": cands[k], "model": name,
                             "date": date, "load": result.load,
                             **({"refused": result.refused} if result.refused else {}),
                             **({"predicted_s": round(pred, 9)} if pred is not None else {})}
    db.write(result.db, result.records)
    _log(options, result)
    return result


#: GEMM pieces are tuned heaviest first until they hold this share of the GEMM time ...
GEMM_SHARE = 0.95
#: ... and none below this share of the whole run (each candidate is an LLVM compile)
GEMM_MIN_SHARE = 0.005


def _heaviest(times: Mapping[str, float], total: float) -> list:
    """The keys of ``times`` worth a GEMM round: heaviest first, until they hold ``GEMM_SHARE``
    of the sum, none under ``GEMM_MIN_SHARE`` of ``total`` (MobileNetV3 has 60-odd GEMM pieces,
    most a few microseconds: compiling their candidates would spend the budget on nothing)."""
    order = sorted(times, key=lambda k: -times[k])
    out, acc, whole = [], 0.0, sum(times.values())
    for k in order:
        if acc >= GEMM_SHARE * whole or times[k] < GEMM_MIN_SHARE * total:
            break
        out.append(k)
        acc += times[k]
    return out


def _ab_ratio(a, b, feeds, rounds: int, reps: int) -> float:
    """Median over ``rounds`` of (median of ``reps`` runs of ``a``) / (the same of ``b``), the
    order alternating per round (the two are compared under the same load)."""
    def med(exe):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            exe.run(feeds)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    ratios = []
    for r in range(rounds):
        if r % 2:
            tb, ta = med(b), med(a)
        else:
            ta, tb = med(a), med(b)
        ratios.append(ta / tb)
    return statistics.median(ratios)


def plan_steps(exe) -> list:
    """What a plan's steps are, for comparing plans: kind, ops, tiles, parts, a generated
    GEMM's blocking, layout and thread choice, the groups layer 3 runs together (no value names
    or times)."""
    from ..runtime.cpu import KernelStep, _parts
    out = []
    for s, spec in zip(exe.steps, exe.plan.kernels):
        d = spec.to_dict()
        row = [d["kind"], d.get("ops")]
        if isinstance(s, KernelStep):
            k = getattr(s.compiled, "kernel", None)     # its code decisions (tuning/kernels.py)
            row += [list(s.fused.tile_sizes), _parts(s, exe.machine), getattr(k, "vector_width", None),
                    getattr(k, "parallel_var", None)]
        cg = getattr(s, "compiled", None)
        if getattr(cg, "blocking", None) is not None:       # a generated GEMM: blocking, tiles, threads
            import dataclasses
            row += [list(dataclasses.astuple(cg.blocking)), list(dataclasses.astuple(cg.layout)), bool(cg.inline)]
        elif type(cg).__name__ == "CompiledDirectConv":     # a direct conv: its form and thread choice
            from ..codegen.conv_direct import flat_form
            row += [flat_form(cg.desc), bool(cg.inline)]
        out.append(row)
    index = {id(s): i for i, s in enumerate(exe.steps)}
    out.append(["launches", [[index[id(s)] for s in item] for kind, item in exe._schedule if kind == "kernels"]])
    return out


def _kind(step) -> str:
    from ..runtime.cpu import KernelStep
    if isinstance(step, KernelStep):
        return "kernel"
    name = type(step).__name__
    return {"GemmStep": "gemm", "BlasStep": "blas"}.get(name, "numpy")


def _log(options: Options, result: TuneResult) -> None:
    """One ``tuning_result`` event per piece: measured (tuned, default) vs predicted times."""
    from ..feedback.log import log_event
    try:
        for k, r in result.records.items():
            log_event(options, "tuning_result", k, time_ms=r["tuned_s"] * 1e3,
                      detail={"kind": r["kind"], "decision": r["decision"], "default_ms": r["default_s"] * 1e3,
                              "predicted_ms": r["predicted_s"] * 1e3 if "predicted_s" in r else None,
                              "candidates": r["candidates"]})
    except OSError:      # the log is advisory
        pass


def _recalibrate(options: Options, meas: _Measurement) -> None:
    """Per step kind, the median ``measured / predicted`` seconds of ``meas``' one-step
    dispatches, merged into ``cost_corrections.json`` (tuning/db.py)."""
    m = meas.exe.machine
    ratios: dict[str, list[float]] = {}
    for d in meas.prof.steps:
        if len(d.steps) != 1 or d.seconds <= 0:
            continue
        pred = m.cost(d.bytes, d.flops)
        ratios.setdefault(_kind(meas.exe.steps[d.steps[0]]), []).append(d.seconds / pred)
    factors = {k: statistics.median(v) for k, v in ratios.items() if len(v) >= 3}
    if not factors:
        return
    # merged with the factors of earlier models, weighted by their step counts
    old, old_n = db.corrections(options.replace(tune="replay")), db.correction_counts(options)
    counts = {k: len(ratios[k]) for k in factors}
    for k, f in old.items():
        n_old = old_n.get(k, 1)
        if k in factors:
            factors[k] = (factors[k] * counts[k] + f * n_old) / (counts[k] + n_old)
            counts[k] += n_old
        else:
            factors[k], counts[k] = f, n_old
    try:
        db.write_corrections(options, {k: round(v, 4) for k, v in factors.items()}, counts)
    except OSError:
        pass
