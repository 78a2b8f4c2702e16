"""Feedback: the structured event log of every decision not to fuse (DESIGN §11)."""
from .log import EVENTS, default_log_path, log_event, read_events

__all__ = ["EVENTS", "default_log_path", "log_event", "read_events"]
