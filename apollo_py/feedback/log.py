"""Append-only JSON-lines event log (DESIGN §11).

One JSON object per line with the fields ``event``, ``signature``, ``model``, ``sizes``,
``time_ms``, ``detail`` and ``timestamp``.  Appends are one ``os.write`` of one whole line on a
file descriptor opened with ``O_APPEND``, so concurrent threads and processes never interleave
partial lines (POSIX appends of one write are atomic with respect to the file offset).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator, Mapping

from ..options import Options

EVENTS = ("schedule_budget_exceeded", "multiple_fusion_groups", "stitch_rejected",
          "parallel_rejected", "tuning_result")


def default_log_path(options: Options) -> str:
    """``options.feedback_path``, else ``<cache_dir>/feedback.jsonl``."""
    return options.feedback_path or os.path.join(options.cache_dir, "feedback.jsonl")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):          # numpy scalars
        return value.item()
    return str(value)


def log_event(options: Options, event: str, signature: str, *, sizes: Any = None,
              time_ms: float | None = None, detail: Mapping[str, Any] | str | None = None,
              path: str | None = None) -> dict:
    """Append one event to the log and return the record written.

    ``event`` should be one of :data:`EVENTS` (others are accepted, for extensions); the log's
    directory is created when missing.
    """
    record = {
        "event": event,
        "signature": signature,
        "model": options.model_name,
        "sizes": _jsonable(sizes),
        "time_ms": None if time_ms is None else round(float(time_ms), 3),
        "detail": _jsonable(detail),
        "timestamp": time.time(),
    }
    target = path or default_log_path(options)
    d = os.path.dirname(os.path.abspath(target))
    os.makedirs(d, exist_ok=True)
    line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def iter_events(path: str) -> Iterator[dict]:
    """Events of the log at ``path`` in order; a missing file has none.  A line that is not a
    JSON object (torn by a crash, bytes that are not UTF-8, another tool's writes) is skipped:
    the log is advisory, and one bad line must not hide the others."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for raw in f:
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                event = json.loads(line)
            except (UnicodeDecodeError, ValueError):
                continue
            if isinstance(event, dict):
                yield event


def read_events(path: str, event: str | None = None) -> list[dict]:
    """All events in the log at ``path`` (only those named ``event`` if given)."""
    return [e for e in iter_events(path) if event is None or e.get("event") == event]
