"""Feedback report: the event log aggregated by pattern, with proposed rule changes.

Groups events by (event, pattern signature), counts them, and for patterns that blew the
scheduling budget or whose stitch was rejected proposes the rule-overlay entry that would split
them up front next time (``[[disable_for]]`` of the partition overlay, see partition/rules.py).
"""
from __future__ import annotations

import html as _html
import os
from collections import defaultdict

from ..options import Options
from .log import default_log_path, read_events

_PROPOSALS = {
    "schedule_budget_exceeded": "split up front: add a [[disable_for]] entry for the rule that built it",
    "multiple_fusion_groups": "split up front: isl found no single fusion group",
    "stitch_rejected": "do not stitch this pattern in layer 2",
    "parallel_rejected": "leave these kernels unstitched (gain below threshold)",
}


def summarize(events: list[dict]) -> list[dict]:
    """One row per (event, signature): count, mean time in ms, models seen, proposal."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        groups[(e.get("event", "?"), e.get("signature", ""))].append(e)
    rows = []
    for (event, sig), es in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        times = [float(e.get("time_ms") or 0.0) for e in es]
        rows.append({"event": event, "signature": sig, "count": len(es),
                     "mean_ms": sum(times) / len(times), "models": sorted({e.get("model") or "" for e in es}),
                     "proposal": _PROPOSALS.get(event, "")})
    return rows


def render(options: Options, html: bool = False) -> str:
    """The report for the log at ``options`` (text, or an HTML page with ``html=True``)."""
    path = default_log_path(options)
    if not os.path.exists(path):
        return f"no feedback events yet ({path} does not exist)"
    rows = summarize(read_events(path))
    if html:
        cells = "".join(
            f"<tr><td>{r['count']}</td><td>{_html.escape(r['event'])}</td><td>{r['mean_ms']:.1f}</td>"
            f"<td><code>{_html.escape(r['signature'])}</code></td><td>{_html.escape(r['proposal'])}</td></tr>"
            for r in rows)
        css = ("body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}"
               "td,th{border:1px solid #cbd5e1;padding:2px 6px;font-size:12px}")   # plan_html.py's look
        return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>apollo_py feedback</title>'
                f"<style>{css}</style></head><body><h1>apollo_py feedback</h1>"
                f"<p>{_html.escape(path)}: {sum(r['count'] for r in rows)} events, {len(rows)} patterns</p>"
                "<table><tr><th>count</th><th>event</th>"
                f"<th>mean ms</th><th>pattern</th><th>proposal</th></tr>{cells}</table></body></html>")
    lines = [f"feedback report for {path}: {sum(r['count'] for r in rows)} events, {len(rows)} patterns"]
    for r in rows:
        lines.append(f"{r['count']:>5}  {r['event']:<26} {r['mean_ms']:8.1f} ms  {r['signature'][:100]}")
        if r["proposal"]:
            lines.append(f"       -> {r['proposal']}")
    return "\n".join(lines)
