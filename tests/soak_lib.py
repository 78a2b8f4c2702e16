"""Soak checks (issue #16 item 7), shared by ``tests/test_soak.py`` (reduced counts, in
``make test``) and ``tools/soak.py`` (``make soak``: the full counts).

* :func:`soak_calls`: call a compiled model many times; resident memory (RSS) and open file
  descriptors are sampled along the way, after a warm-up, so a leak of a few bytes per call
  shows as a trend over 100,000 calls while allocator noise stays within the tolerance;
* :func:`killed_compiles`: start compiles of a model into one cache directory in child
  processes and SIGKILL each at a random moment; then every entry the cache would read must be
  complete (:func:`cache_problems`), a fresh compile there must give the right numbers, and
  the sweep must remove what the kills left (temp files, half entries).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SMALL_ZOO = ROOT / "tests" / "models" / "zoo"


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def open_fds() -> int:
    """Open file descriptors of this process (Linux /proc; -1 where unavailable)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def zoo_feeds(name: str, directory: Path = SMALL_ZOO, seed: int = 0) -> dict:
    """Seeded inputs for a zoo model, from its manifest (ids below ``high``)."""
    spec = json.loads((directory / "manifest.json").read_text())[name]
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in spec["inputs"]:
        if np.dtype(i["dtype"]).kind in "iu":
            feeds[i["name"]] = rng.integers(0, i.get("high", 2), i["shape"]).astype(i["dtype"])
        else:
            feeds[i["name"]] = rng.standard_normal(i["shape"]).astype(i["dtype"])
    return feeds


def as_list(result) -> list:
    """A model call's outputs as a list (a one-output model returns the bare array)."""
    return [result] if isinstance(result, np.ndarray) else list(result)


def soak_calls(f, feeds: dict, calls: int, *, warmup: int | None = None, samples: int = 10,
               out=None) -> dict:
    """Call ``f(**feeds)`` ``calls`` times after ``warmup`` calls (default: 5% of ``calls``, at
    least 20), sampling RSS and open fds ``samples`` times.  The first result is checked
    against every later one at the sample points (a recycled output that changed shows).

    Returns ``{"calls", "seconds", "rss": [...], "fds": [...], "rss_growth", "fds_growth",
    "mismatches"}``: growths are last sample minus first (after the warm-up)."""
    warmup = max(20, calls // 20) if warmup is None else warmup
    first = [np.array(o, copy=True) for o in as_list(f(**feeds))]
    for _ in range(warmup):
        f(**feeds)
    rss, fds, mismatches = [rss_bytes()], [open_fds()], 0
    every = max(1, calls // samples)
    t0 = time.perf_counter()
    for k in range(1, calls + 1):
        got = f(**feeds) if out is None else f(**feeds, out=out)
        if k % every == 0:
            if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, as_list(got), strict=True)):
                mismatches += 1
            rss.append(rss_bytes())
            fds.append(open_fds())
    seconds = time.perf_counter() - t0
    return {"calls": calls, "seconds": seconds, "rss": rss, "fds": fds, "rss_growth": rss[-1] - rss[0],
            "fds_growth": fds[-1] - fds[0], "mismatches": mismatches}


def cache_problems(cache_dir: str) -> list[str]:
    """Files of ``cache_dir`` that are not whole: a piece (``<key>.piece``, written by one
    rename) whose metadata line does not describe its payload (size and checksum), or a JSON
    file (machine figures, checker markers) that does not parse.  Temp files and the two-file
    entries of earlier versions are not problems here (readers never open them);
    :func:`stale_files` lists those."""
    bad = []
    for dirpath, _, files in os.walk(cache_dir):
        in_pieces = os.path.basename(os.path.dirname(dirpath)) == "pieces"
        for f in files:
            p = os.path.join(dirpath, f)
            if f.startswith(".tmp-") or (in_pieces and f.endswith((".bin", ".json"))):
                continue
            if f.endswith(".piece"):
                head, _, payload = Path(p).read_bytes().partition(b"\n")
                try:
                    meta = json.loads(head)
                except ValueError:
                    meta = None
                if not isinstance(meta, dict) or hashlib.sha256(payload).hexdigest() != meta.get("sha256") \
                        or len(payload) != meta.get("size"):
                    bad.append(p)
            elif f.endswith(".json"):
                try:
                    json.loads(Path(p).read_text())
                except ValueError:
                    bad.append(p)
    return bad


def stale_files(cache_dir: str) -> list[str]:
    """Temp files (what a killed writer can leave) and two-file piece entries of earlier
    versions: what ``cache.sweep_stale`` deletes once they are old."""
    out = []
    for dirpath, _, files in os.walk(cache_dir):
        in_pieces = os.path.basename(os.path.dirname(dirpath)) == "pieces"
        for f in files:
            if f.startswith(".tmp-") or (in_pieces and f.endswith((".bin", ".json"))):
                out.append(os.path.join(dirpath, f))
    return out


_CHILD = """
import sys, numpy as np, apollo_py as ap
sys.path.insert(0, {tests!r})
from soak_lib import zoo_feeds
from pathlib import Path
f = ap.jit({model!r}, options=ap.Options(cache_dir={cache!r}))
print("compiling", flush=True)
f(**zoo_feeds({name!r}, Path({zoo!r})))
print("done", flush=True)
"""


def killed_compiles(model: Path, cache_dir: str, kills: int, seed: int = 0,
                    max_delay: float = 3.0) -> dict:
    """Start ``kills`` compiles of ``model`` (each in a fresh process, all into ``cache_dir``)
    and SIGKILL each after a random delay in [0, ``max_delay``) s counted from the moment it
    starts compiling.  Returns ``{"killed", "finished", "started", "problems", "stale"}``
    (``started``: children that reached the compile)."""
    rng = np.random.default_rng(seed)
    code = _CHILD.format(tests=str(ROOT / "tests"), model=str(model), cache=cache_dir, name=model.name,
                         zoo=str(model.parent))
    env = dict(os.environ, APOLLO_PY_CACHE_DIR=cache_dir)
    killed = finished = started = 0
    for _ in range(kills):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=env, text=True)
        started += p.stdout.readline().strip() == "compiling"     # the compile starts now
        time.sleep(float(rng.uniform(0, max_delay)))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            killed += 1
        else:
            finished += 1
        p.wait()
        p.stdout.close()
    return {"killed": killed, "finished": finished, "started": started, "problems": cache_problems(cache_dir),
            "stale": stale_files(cache_dir)}
