"""Machine figures: what the cost model (DESIGN §7) and the runtime's dispatch assume.

A :class:`Machine` holds the figures every decision that depends on the machine reads:
memory bandwidth and compute peak (``cost = max(bytes/bandwidth, flops/peak) + launch``, layer
3's grouping), the cost of one parallel launch, and the runtime's dispatch sizes (below
``inline_bytes`` a kernel runs on the calling thread; a parallel chunk moves about
``chunk_bytes``).  Where they come from is the user's choice, through ``Options.machine``:

* a :class:`Machine` (figures pinned by hand, e.g. from another machine's ``apollo-py machine
  --json``), or the name of a preset in :data:`PRESETS`;
* ``None`` (the default): figures measured on this machine and kept in
  ``<cache_dir>/machine.json``, re-measured when the hardware there changed (another CPU model
  or core count), when the file is from an older format, or on request
  (``apollo-py machine --measure``).

Measurement (:func:`measure_machine`) runs several rounds and keeps the best of each figure
(a neighbour that steals memory bandwidth or a core for a moment can only make a round slower,
never faster), checks the result against what the hardware reports (cores, vector width, clock:
a compute peak far below what those allow is implausible) and measures again, up to
``MAX_ATTEMPTS`` times, while it is implausible or the rounds spread too much.  The rounds'
spread and the checks are recorded with the figures.  docs/design/machine.md says why this
design, and how peers (TVM, XLA, Inductor) describe machines.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field, fields, replace

from .errors import OptionsError

MiB = 1 << 20


@dataclass(frozen=True)
class Machine:
    """Figures of one machine (decisions only read these; ``source`` and ``notes`` say where
    they came from and take no part in equality).

    ``bandwidth``: bytes/s of streaming memory traffic (one thread, data larger than the last
    cache level); ``peak``: float32 flop/s of FMAs on the widest vectors, every core busy
    (a generated loop, ``apollo_py.codegen.fma_peak``, passed in as ``probe``); ``launch``: seconds one
    parallel launch costs (a thread-pool dispatch); ``inline_bytes``: kernels (or layer-3
    groups) moving fewer bytes run on the calling thread; ``chunk_bytes``: bytes one chunk of a
    parallel loop moves at least.
    """

    bandwidth: float
    peak: float
    #: not measured: layer 3's threshold; an empty dispatch of the Python thread pool costs
    #: about 35 us, but 10 us is what the layer-3 policy was tuned with (benchmarks/RESULTS.md)
    launch: float = 10e-6
    #: a pool dispatch costs about 35 us before any work (worker wake-up, GIL hand-offs);
    #: tanh(x)+y with cache-hot operands on the 2-core box, inline vs 2 chunks: 384 KiB 11 vs
    #: 48 us, 1.5 MiB 40 vs 78-114 us, 3 MiB 94 vs 166 us, 6 MiB 200 vs 216 us.  In-process A/B
    #: of 64 KiB, 1 MiB and 2 MiB: wide_deep 1.00 / 0.99 / 0.93-0.95 (its eight 160 KiB bag
    #: sums); of 2, 4 and 8 MiB: four_branches (4 x 1 MiB) 1.00 / 0.98 / 0.89; wide_deep,
    #: bias_maxpool, conv_bn_lrelu_res, bert_layer within 1% at every value.  It also covers
    #: kernels right after a BLAS call, whose worker threads spin for a while and hold a core
    #: (MLP training step: ReLU epilogue 0.19-0.23 ms on the pool, 0.14 ms inline).  Measured
    #: with 2 threads: with more cores the pool pays off earlier and this should shrink.
    inline_bytes: int = 8 * MiB
    #: each chunk is one ctypes call plus a claim under the GIL (a 512 x 4 x 16 bag sum cut
    #: into 8 chunks was overhead-bound; four_branches' 4 x 1 MiB group, busy 2-core box:
    #: 128 KiB chunks 0.47 ms, 1 MiB 0.41 ms; softmax [768,128,128] the same for 64 KiB..4 MiB)
    chunk_bytes: int = 1 * MiB
    source: str = field(default="pinned", compare=False)
    notes: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        for f in ("bandwidth", "peak", "launch", "inline_bytes", "chunk_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v or v < 0 \
                    or (f in ("bandwidth", "peak", "chunk_bytes") and v <= 0) or v == float("inf"):
                raise OptionsError(f"Machine.{f} must be a finite positive number, got {v!r}")

    def cost(self, nbytes: float, flops: float) -> float:
        """Predicted seconds for a kernel moving ``nbytes`` and doing ``flops``."""
        return max(nbytes / self.bandwidth, flops / self.peak) + self.launch

    def is_compute_bound(self, nbytes: float, flops: float) -> bool:
        return flops / self.peak > nbytes / self.bandwidth

    def figures(self) -> dict:
        """The decision-relevant figures as a plain dict (what ``machine.json`` stores)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}

    def replace(self, **kw) -> "Machine":
        return replace(self, **kw)


#: Named machines a user or a test can pin (``Options(machine="slow")``).  ``slow`` and
#: ``fast`` bracket the machines apollo_py runs on (a small laptop core under load; a big
#: server socket); ``dev-2core`` is the 2-core box the figures in benchmarks/RESULTS.md were
#: taken on (2026-11, quiet: 21.5-24.3 GB/s, 177-182 GFLOP/s); ``conservative`` is what
#: compiles without a cache directory assume.
PRESETS: dict[str, Machine] = {
    "slow": Machine(bandwidth=5e9, peak=20e9, source="preset:slow"),
    "fast": Machine(bandwidth=200e9, peak=2e12, source="preset:fast"),
    "dev-2core": Machine(bandwidth=22e9, peak=180e9, source="preset:dev-2core"),
    "conservative": Machine(bandwidth=10e9, peak=50e9, source="preset:conservative"),
}

#: bump when the measurement changes meaning: older machine.json files are measured anew
FORMAT = 3           # 3: peak from the generated FMA loop, not numpy's sgemm
ROUNDS = 7            # rounds per attempt; the best of each figure is kept
MAX_ATTEMPTS = 3      # measure again while implausible or noisy, at most this often
MAX_SPREAD = 0.25     # (best - median) / best above this counts as a noisy attempt
MIN_PEAK_FRACTION = 0.05   # a peak below this fraction of the hardware bound is implausible
MIN_BANDWIDTH = 0.5e9      # bytes/s below which no real machine streams memory


def preset(name: str) -> Machine:
    """The preset called ``name`` (:data:`PRESETS`), or OptionsError naming the choices."""
    try:
        return PRESETS[name]
    except KeyError:
        raise OptionsError(f"unknown machine preset {name!r}; presets are {sorted(PRESETS)}") from None


# -- what the hardware reports ---------------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(text.rstrip("KMG")) * mult
    except ValueError:
        return 0


def hardware() -> dict:
    """What the OS reports about this CPU: model, usable cores, vector bytes, FMA, clock (GHz,
    0 when unknown) and cache sizes in bytes (``{"L1d": ..., "L2": ..., "L3": ...}``)."""
    cpuinfo = _read("/proc/cpuinfo")
    info: dict = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key and key not in info:
            info[key] = value.strip()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    vector = 64 if "avx512f" in flags else 32 if "avx2" in flags or "avx" in flags else 16
    ghz = 0.0
    khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").strip()
    if khz.isdigit():
        ghz = int(khz) / 1e6
    elif info.get("cpu MHz"):
        try:
            ghz = float(info["cpu MHz"]) / 1e3
        except ValueError:
            pass
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    for idx in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        level = _read(f"{base}/{idx}/level").strip()
        kind = _read(f"{base}/{idx}/type").strip()
        if level and kind != "Instruction":
            caches[f"L{level}{'d' if kind == 'Data' else ''}"] = _size(_read(f"{base}/{idx}/size"))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "cores": cores, "vector_bytes": vector, "fma": "fma" in flags or "asimd" in flags,
            "ghz": round(ghz, 3), "caches": caches}


def peak_bound(hw: dict) -> float:
    """Upper bound of float32 flop/s the hardware reports allow: cores x clock x lanes x 2
    (multiply-add) x 2 (FMA ports); 0 when the clock is unknown."""
    return hw["cores"] * hw["ghz"] * 1e9 * (hw["vector_bytes"] // 4) * 2 * 2


def _fingerprint(hw: dict) -> dict:
    """The part of :func:`hardware` that, when it changes, makes stored figures stale."""
    return {"cpu": hw["cpu"], "cores": hw["cores"], "vector_bytes": hw["vector_bytes"]}


# -- measuring -------------------------------------------------------------------------------

def _rounds(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _best_and_spread(rates: list[float]) -> tuple[float, float]:
    import statistics
    best = max(rates)
    return best, (best - statistics.median(rates)) / best


def _measure_once(hw: dict, rounds: int, probe=None) -> dict:
    """One attempt: best-of-``rounds`` bandwidth and peak, with the rounds' spread."""
    import numpy as np
    last = max(hw["caches"].values(), default=0)
    n = min(256 * MiB, max(16 * MiB, 2 * last)) // 4        # floats per array, beyond the caches
    a, b, c = (np.ones(n, np.float32) for _ in range(3))

    def triad():
        np.multiply(c, 2.0, out=a)      # read c, write a
        np.add(a, b, out=a)             # read a, b, write a
    triad()
    bw, bw_spread = _best_and_spread([5 * 4 * n / t for t in _rounds(triad, rounds)])
    pk, pk_spread, how = _peak(hw, rounds, probe)
    return {"bandwidth": bw, "peak": pk, "spread": {"bandwidth": round(bw_spread, 4), "peak": round(pk_spread, 4)},
            "working_set_bytes": 3 * 4 * n, "peak_from": how}


def _peak(hw: dict, rounds: int, probe=None) -> tuple[float, float, str]:
    """(best flop/s, spread, how).  ``probe(threads) -> (flop/s, description)`` is the compiler's
    generated FMA loop on the widest vectors the CPU executes, on every core at once
    (:func:`apollo_py.codegen.fma_peak.peak_probe`; passed in, because this bottom layer may not
    import LLVM): numpy's BLAS measures whatever kernel its build picked (an OpenBLAS pinned to
    Haswell runs AVX2 on an AVX-512 core: half the peak).  Without a probe, or if it fails, a
    512^3 sgemm through numpy stands in and ``how`` says so."""
    why = "no probe given"
    if probe is not None:
        try:
            runs = [probe(hw["cores"]) for _ in range(rounds)]
            pk, spread = _best_and_spread([r for r, _ in runs])
            return pk, spread, runs[0][1]
        except Exception as e:     # noqa: BLE001 -- any JIT failure: measure through numpy instead
            why = f"probe failed: {type(e).__name__}: {e}"
    import numpy as np
    m = np.ones((512, 512), np.float32)
    m @ m
    pk, spread = _best_and_spread([2 * 512 ** 3 / t for t in _rounds(lambda: m @ m, rounds)])
    return pk, spread, f"numpy 512^3 sgemm ({why})"


def _problems(m: dict, hw: dict) -> list[str]:
    """Why measured figures ``m`` look wrong for hardware ``hw`` (empty when plausible)."""
    out = []
    bound = peak_bound(hw)
    if bound and m["peak"] < MIN_PEAK_FRACTION * bound:
        out.append(f"peak {m['peak'] / 1e9:.1f} GFLOP/s is below {MIN_PEAK_FRACTION:.0%} of the "
                   f"{bound / 1e9:.0f} GFLOP/s the hardware allows")
    if m["bandwidth"] < MIN_BANDWIDTH:
        out.append(f"bandwidth {m['bandwidth'] / 1e9:.2f} GB/s is below {MIN_BANDWIDTH / 1e9} GB/s")
    for k, s in m["spread"].items():
        if s > MAX_SPREAD:
            out.append(f"{k} rounds spread {s:.0%} (a busy neighbour?)")
    return out


def measure_machine(rounds: int = ROUNDS, attempts: int = MAX_ATTEMPTS, probe=None) -> Machine:
    """Measure this machine's figures (about 0.3-1 s per attempt); see the module docstring.
    ``probe``: the peak measurement (:func:`_peak`; the compiler passes its FMA loop).

    Keeps the best figure over all attempts; ``notes`` records the hardware, each attempt's
    figures and spread, and any problem the last attempt still had.
    """
    hw = hardware()
    tries, problems = [], []
    for k in range(attempts):
        if k:
            time.sleep(0.05 * k)        # let a momentary neighbour pass
        m = _measure_once(hw, rounds, probe) if probe is not None else _measure_once(hw, rounds)
        tries.append(m)
        problems = _problems(m, hw)
        if not problems:
            break
    bw = max(t["bandwidth"] for t in tries)
    pk = max(t["peak"] for t in tries)
    notes = {"format": FORMAT, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "hardware": hw, "peak_bound": peak_bound(hw), "attempts": tries, "problems": problems,
             "rounds": rounds}
    return Machine(bandwidth=bw, peak=pk, source="measured", notes=notes)


# -- where the figures come from -------------------------------------------------------------

def machine_path(cache_dir: str) -> str:
    return os.path.join(cache_dir, "machine.json")


def load_machine(cache_dir: str) -> Machine | None:
    """Figures stored in ``cache_dir`` if they are current for this hardware, else None."""
    path = machine_path(cache_dir)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        notes = data["notes"]
        if notes.get("format") != FORMAT or notes["hardware"]["cpu"] is None:
            return None
        if _fingerprint(notes["hardware"]) != _fingerprint(hardware()):
            return None
        return Machine(**data["figures"], source=f"cached:{path}", notes=notes)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OptionsError):
        return None     # unreadable or not the expected objects: measure again


def save_machine(cache_dir: str, machine: Machine) -> str:
    """Write ``machine`` to ``<cache_dir>/machine.json`` atomically; returns the path."""
    from .fsutil import atomic_write
    path = machine_path(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    atomic_write(path, json.dumps({"figures": machine.figures(), "notes": machine.notes}, indent=1).encode())
    return path


_MEASURED: dict[str, Machine] = {}     # per cache dir: figures measured in this process


def measured_machine(cache_dir: str | None, remeasure: bool = False, probe=None) -> Machine:
    """This machine's figures: stored in ``cache_dir`` when current, else measured.

    Plausible figures are stored for later processes; figures that still looked wrong after
    every attempt (a busy neighbour) serve this process only, so the next one measures again
    instead of calibrating every later plan to a noisy moment.
    """
    if not cache_dir:
        return PRESETS["conservative"]
    m = None if remeasure else (_MEASURED.get(cache_dir) or load_machine(cache_dir))
    if m is None:
        m = measure_machine(probe=probe)
        if m.notes["problems"]:
            m = replace(m, source="measured; not saved, implausible: " + "; ".join(m.notes["problems"]))
        else:
            try:
                m = replace(m, source=f"measured, saved to {save_machine(cache_dir, m)}")
            except OSError as e:
                m = replace(m, source=f"measured (not saved: {e.strerror or e})")
    _MEASURED[cache_dir] = m
    return m


def resolve_machine(options, probe=None) -> Machine:
    """The figures ``options.machine`` asks for: a Machine as given, a preset by name, or
    (None) this machine's measured figures kept in ``options.cache_dir`` (``probe``: the peak
    measurement, see :func:`_peak`)."""
    m = options.machine
    if isinstance(m, Machine):
        return m
    if isinstance(m, str):
        return preset(m)
    return measured_machine(options.cache_dir, probe=probe)


def describe(machine: Machine) -> dict:
    """A JSON-able view of ``machine``: figures, where they came from, the measurement notes."""
    return {"figures": machine.figures(), "source": machine.source, **({"notes": machine.notes} if machine.notes else {})}


def as_text(machine: Machine) -> str:
    """Human-readable lines for ``apollo-py machine``."""
    n = machine.notes
    lines = [f"source:       {machine.source}",
             f"bandwidth:    {machine.bandwidth / 1e9:.1f} GB/s",
             f"peak:         {machine.peak / 1e9:.1f} GFLOP/s",
             f"launch:       {machine.launch * 1e6:.1f} us",
             f"inline below: {machine.inline_bytes / MiB:g} MiB; chunks of {machine.chunk_bytes / MiB:g} MiB"]
    hw = n.get("hardware")
    if hw:
        caches = ", ".join(f"{k} {v // 1024} KiB" for k, v in hw["caches"].items())
        lines.append(f"hardware:     {hw['cpu']}, {hw['cores']} cores, {hw['vector_bytes'] * 8}-bit vectors, "
                     f"{hw['ghz']} GHz; {caches}")
    if n.get("measured_at"):
        spreads = "; ".join(f"{k} {v:.1%}" for k, v in n["attempts"][-1]["spread"].items())
        lines.append(f"measured:     {n['measured_at']}, {len(n['attempts'])} attempt(s) of {n['rounds']} "
                     f"rounds, best-of; last spread {spreads}")
    for p in n.get("problems") or ():
        lines.append(f"warning:      {p}")
    return "\n".join(lines)


def machine_json(machine: Machine) -> str:
    return json.dumps(describe(machine), indent=1)


__all__ = ["Machine", "PRESETS", "preset", "hardware", "measure_machine", "load_machine", "save_machine",
           "measured_machine", "resolve_machine", "describe", "as_text"]
