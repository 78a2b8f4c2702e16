"""The tuning database: per-piece decisions keyed by piece hash and machine (DESIGN §11).

One JSON file (``Options.tune_db``, default ``<cache_dir>/tuning.json``)::

    {"format": 1,
     "machines": {"<machine key>": {"machine": {"cpu": ..., "cores": ..., "features": ...},
                                    "pieces": {"<piece key>": {"kind": ..., "decision": {...},
                                                               "tuned_s": ..., "default_s": ...,
                                                               "predicted_s": ..., "candidates": {...},
                                                               "model": ..., "date": ..., "load": {...},
                                                               ["refused": why]}}}}}

Only *decisions* are stored (tile sizes, chunk counts, stitch or not, BLAS or generated GEMM,
GEMM blockings, kernels' vector width and parallel dim, direct convs' form and threads, layer-3
grouping), never code: a replaying compile builds the code from them through the usual passes
and caches.  ``load`` is what other processes took of the cores while they were timed
(tuning/load.py); ``refused`` says why a tuning stored the defaults instead.  A compile reads only the section of this machine's key
(:func:`machine_key`: CPU model, CPU feature flags, usable cores), so a database copied from
another machine is ignored.  Piece keys (:func:`piece_key`) hash a piece's structure with value
names made canonical (the same block at every layer is one piece) and its value types (the
real shapes).

Cost-model corrections measured by the tuner (``measured / predicted`` per step kind) are kept
next to ``machine.json`` in ``<cache_dir>/cost_corrections.json``, also per machine key.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from functools import lru_cache
from typing import Mapping, Sequence

FORMAT = 1
#: the kinds of piece a decision is stored for
KINDS = ("stitch", "group", "kernel", "run", "gemm", "conv")
_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def machine_key() -> str:
    """Key of this machine's decisions: sha256 of the CPU model, its feature flags and the
    usable core count (what decides whether a measured choice carries over)."""
    from ..machine import hardware
    hw = hardware()
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() in ("flags", "Features"):
                    flags = " ".join(sorted(v.split()))
                    break
    except OSError:
        pass
    doc = {"cpu": hw["cpu"], "cores": hw["cores"], "features": hashlib.sha256(flags.encode()).hexdigest()[:16]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def machine_doc() -> dict:
    """What the machine key was made of (stored beside the decisions, for people)."""
    from ..machine import hardware
    hw = hardware()
    return {"cpu": hw["cpu"], "cores": hw["cores"], "vector_bytes": hw["vector_bytes"]}


def db_path(options) -> str:
    return options.tune_db or os.path.join(options.cache_dir, "tuning.json")


def corrections_path(options) -> str:
    return os.path.join(options.cache_dir, "cost_corrections.json")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


@lru_cache(maxsize=32)
def _section(path: str, stamp: tuple, key: str) -> tuple:
    doc = _read_json(path)
    if doc.get("format") != FORMAT:
        return ()
    pieces = ((doc.get("machines") or {}).get(key) or {}).get("pieces") or {}
    return tuple(sorted((k, json.dumps(v.get("decision") or {}, sort_keys=True))
                        for k, v in pieces.items() if isinstance(v, dict)))


def decisions(options) -> dict[str, dict]:
    """Piece key -> decision stored for this machine in ``options``' database; empty when
    ``options.tune == "off"``, for targets other than "cpu", without a database, or when it has no section for this machine.
    Re-read when the file's mtime or size changes."""
    if options.tune == "off" or options.target != "cpu":     # decisions are timed on the CPU target
        return {}
    path = db_path(options)
    try:
        st = os.stat(path)
    except OSError:
        return {}
    return {k: json.loads(v) for k, v in _section(path, (st.st_mtime_ns, st.st_size), machine_key())}


def digest(options) -> str:
    """Digest of the decisions a compile with ``options`` applies ("" = none): part of the
    model cache's key, so a stored compile is not reused after the decisions changed."""
    d = decisions(options)
    if not d:
        return ""
    return hashlib.sha256(json.dumps(sorted(d.items()), sort_keys=True).encode()).hexdigest()


def write(path: str, records: Mapping[str, dict], key: str | None = None) -> None:
    """Merge ``records`` (piece key -> record with ``kind`` and ``decision``) into the section
    of machine ``key`` (default: this machine) of the database at ``path`` (atomic write)."""
    from ..fsutil import atomic_write
    key = key or machine_key()
    with _LOCK:
        doc = _read_json(path)
        if doc.get("format") != FORMAT:
            doc = {"format": FORMAT, "machines": {}}
        sec = doc.setdefault("machines", {}).setdefault(key, {"machine": machine_doc(), "pieces": {}})
        sec.setdefault("pieces", {}).update(records)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1, sort_keys=True).encode())


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- piece keys ------------------------------------------------------------------------------

def piece_key(kind: str, nodes: Sequence, types: Mapping, outputs: Sequence[str] = ()) -> str:
    """``kind`` + sha256 of ``nodes``' structure (ops, attributes, wiring in canonical value
    names, value types) and which values leave the piece (``outputs``)."""
    names: dict[str, str] = {}

    def c(v):
        if v not in names:
            names[v] = f"v{len(names)}"
        return names[v]
    doc = [[n.op, n.attrs.canonical(), [c(v) for v in n.inputs], [c(v) for v in n.outputs]] for n in nodes]
    outs = sorted(c(v) for v in outputs)
    tys = sorted((names[v], str(types[v])) for v in names if v in types)
    text = json.dumps({"nodes": doc, "outputs": outs, "types": tys}, sort_keys=True)
    return f"{kind}:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def kernel_key(fused, types: Mapping) -> str:
    """Piece key of a layer-1 kernel (its nodes and the values it writes)."""
    return piece_key("kernel", [n for n in fused.nodes], types, fused.outputs)


def run_key(kernel_keys: Sequence[str]) -> str:
    """Piece key of a run of independent kernels layer 3 may group (their keys, in order)."""
    return "run:" + hashlib.sha256("|".join(kernel_keys).encode()).hexdigest()[:32]


# -- cost-model corrections ------------------------------------------------------------------

def corrections(options) -> dict[str, float]:
    """Per step kind ("kernel", "gemm", "blas", "numpy"): measured / predicted seconds the
    tuner found on this machine ({} when none, or ``tune == "off"``)."""
    if options.tune == "off":
        return {}
    doc = _read_json(corrections_path(options))
    sec = (doc.get("machines") or {}).get(machine_key()) or {}
    return {k: float(v) for k, v in (sec.get("factors") or {}).items()
            if isinstance(v, (int, float)) and v > 0}


def correction_counts(options) -> dict[str, int]:
    """How many measured steps each stored correction factor rests on."""
    sec = (_read_json(corrections_path(options)).get("machines") or {}).get(machine_key()) or {}
    return {k: int(v) for k, v in (sec.get("evidence") or {}).items() if isinstance(v, int)}


def write_corrections(options, factors: Mapping[str, float], evidence: Mapping) -> str:
    from ..fsutil import atomic_write
    path = corrections_path(options)
    doc = _read_json(path)
    doc.setdefault("machines", {})[machine_key()] = {"machine": machine_doc(), "factors": dict(factors),
                                                     "evidence": dict(evidence), "date": stamp()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=True).encode())
    return path
