"""Turn the feedback log into a new, versioned user rule overlay (DESIGN §11).

:func:`apply` reads the event log, proposes one ``[[split]]`` overlay entry per pattern
signature that layer 1 refused (``schedule_budget_exceeded``: over the isl operations budget;
``multiple_fusion_groups``: isl found no single fusion group) and writes the overlay with those
entries added — each with the event that caused it, a reason, the evidence (event count, mean
and total time, budget, models, first and last time seen) and the date.  The next compile with
``Options(rules_overlay=<that file>)`` splits those patterns up front (layers/layer1.py), so the
refusal is neither paid nor logged again.

Versions: the overlay's ``revision`` counts the writes; every revision written is also kept as
``<overlay>.versions/<revision>.toml``, and :func:`revert` puts one of them back.  A pattern
already in the overlay is left as it is (applying the same log twice changes nothing).

Layer-2/3 refusals become entries too: a ``stitch_rejected`` signature (a stitch group layer 1
could not fuse into one kernel) a ``[[no_stitch]]`` entry -- the next compile lowers that group
as its fallback did (the longest stitchable prefix, then the rest) without asking layer 1 for
the whole -- and a ``parallel_rejected`` combination (kernel names joined by ``+``) a
``[[no_parallel]]`` entry, which layer 3 passes over without estimating or logging it again.  A
``[[disable_for]]`` entry needs the aggregation rule that built the pattern, which the log does
not record, so it is not proposed.
"""
from __future__ import annotations

import difflib
import os
import time
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..errors import FeedbackError
from ..fsutil import atomic_write
from .log import read_events

#: events whose pattern the overlay splits up front
SPLIT_EVENTS = ("schedule_budget_exceeded", "multiple_fusion_groups")
#: the overlay table each event's entries go to (partition/rules.py)
TABLES = {"schedule_budget_exceeded": "split", "multiple_fusion_groups": "split",
          "stitch_rejected": "no_stitch", "parallel_rejected": "no_parallel"}
_REASONS = {"schedule_budget_exceeded": "over the isl scheduling budget",
            "multiple_fusion_groups": "isl found no single fusion group",
            "stitch_rejected": "layer 1 gave more than one kernel for the stitch group",
            "parallel_rejected": "layer 3's estimated gain was below its threshold"}


@dataclass
class ApplyResult:
    """What :func:`apply` did: the overlay path, the revision written (None when nothing was new
    or on a dry run), the entries added and the unified diff of the overlay file."""

    path: str
    revision: int | None
    added: list[dict] = field(default_factory=list)
    diff: str = ""


def versions_dir(overlay: str) -> str:
    """Where the revisions of ``overlay`` are kept."""
    return overlay + ".versions"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def proposals(events: list[dict], now: float | None = None) -> list[dict]:
    """One entry per (refusal event, signature) in ``events``, most frequent first; its table
    is ``TABLES[entry["event"]]``."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for e in events:
        if e.get("event") in TABLES and e.get("signature"):
            groups.setdefault((e["event"], e["signature"]), []).append(e)
    date = _stamp(time.time() if now is None else now)
    out = []
    for (event, sig), es in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        times = [float(e.get("time_ms") or 0.0) for e in es]
        stamps = [float(e.get("timestamp") or 0.0) for e in es]
        models = sorted({e.get("model") or "" for e in es} - {""})
        budgets = sorted({(e.get("detail") or {}).get("budget") for e in es
                          if isinstance(e.get("detail"), dict)} - {None})
        evidence: dict[str, Any] = {"events": len(es), "mean_ms": round(sum(times) / len(es), 3),
                                    "total_ms": round(sum(times), 3), "models": models,
                                    "first_seen": _stamp(min(stamps)), "last_seen": _stamp(max(stamps))}
        if budgets:
            evidence["budget"] = budgets
        reason = f"{event}: {_REASONS[event]} {len(es)}x" + (
            f" (budget {', '.join(map(str, budgets))} isl ops)" if budgets else "") + (
            f" in {', '.join(models)}" if models else "")
        out.append({"signature": sig, "event": event, "reason": reason, "date": date, "evidence": evidence})
    return out


def _read_overlay(path: str) -> tuple[dict, str]:
    """The overlay at ``path`` as (document, text); an absent file is an empty overlay."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {"version": 1}, ""
    except OSError as e:
        raise FeedbackError(f"overlay {path!r} cannot be read: {e}") from None
    try:
        return tomllib.loads(raw.decode()), raw.decode()
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FeedbackError(f"overlay {path!r} is not valid TOML: {e}") from None


def _dumps(doc: dict) -> str:
    import tomli_w
    head = ("# apollo_py rule overlay (partition/rules.py); written by `apollo-py feedback apply`.\n"
            "# Earlier revisions: <this file>.versions/<revision>.toml; `apollo-py feedback revert N`.\n")
    return head + tomli_w.dumps(doc)


def _diff(old: str, new: str, path: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        fromfile=f"{path} (current)", tofile=f"{path} (new)"))


def apply(log: str, overlay: str, *, dry_run: bool = False, now: float | None = None) -> ApplyResult:
    """Add the log's proposals (:func:`proposals`) that ``overlay`` lacks as a new revision.

    ``log`` is a JSON-lines feedback log (feedback/log.py), ``overlay`` the TOML overlay to
    update (created when absent).  With ``dry_run`` nothing is written; the result's ``diff``
    shows what would change.  Returns an :class:`ApplyResult`.
    """
    if not os.path.exists(log):
        raise FeedbackError(f"feedback log {log!r} does not exist")
    doc, old_text = _read_overlay(overlay)
    have = {(t, e.get("signature")) for t in set(TABLES.values()) for e in doc.get(t, [])}
    added, seen = [], set()
    for p in proposals(read_events(log), now):
        key = (TABLES[p["event"]], p["signature"])
        if key not in have and key not in seen:     # two split events of one signature: one entry
            seen.add(key)
            added.append(p)
    if not added:
        return ApplyResult(overlay, None, [], "")
    revision = max([int(doc.get("revision", 0))] + _revisions(overlay)) + 1
    new = dict(doc)
    new["version"] = doc.get("version", 1)
    new["revision"] = revision
    for table in dict.fromkeys(TABLES.values()):
        entries = [p for p in added if TABLES[p["event"]] == table]
        if entries:
            new[table] = list(doc.get(table, [])) + entries
    text = _dumps(new)
    result = ApplyResult(overlay, None if dry_run else revision, added, _diff(old_text, text, overlay))
    if not dry_run:
        os.makedirs(versions_dir(overlay), exist_ok=True)
        atomic_write(os.path.join(versions_dir(overlay), f"{revision}.toml"), text.encode())
        atomic_write(overlay, text.encode())
    return result


def _revisions(overlay: str) -> list[int]:
    try:
        names = os.listdir(versions_dir(overlay))
    except OSError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".toml") and n[:-5].isdigit())


def revisions(overlay: str) -> list[int]:
    """The revisions of ``overlay`` that :func:`revert` can put back, oldest first."""
    return _revisions(overlay)


def revert(overlay: str, revision: int) -> str:
    """Put revision ``revision`` of ``overlay`` back in place (``0``: an overlay without
    entries); returns a one-line description of what was done."""
    if revision == 0:
        atomic_write(overlay, _dumps({"version": 1, "revision": 0}).encode())
        return f"{overlay} is revision 0 (no entries) again"
    src = os.path.join(versions_dir(overlay), f"{revision}.toml")
    try:
        with open(src, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FeedbackError(f"overlay {overlay!r} has no revision {revision}; "
                            f"revisions are {_revisions(overlay) or 'none'}") from None
    atomic_write(overlay, data)
    return f"{overlay} is revision {revision} again"
