"""Feedback: the structured event log of every decision not to fuse (DESIGN §11), and the
rule overlay written from it (:func:`apply`, :func:`revert`)."""
from .overlay import ApplyResult, FeedbackError, apply, revert, revisions
from .log import EVENTS, default_log_path, log_event, read_events

__all__ = ["EVENTS", "ApplyResult", "FeedbackError", "apply", "default_log_path", "log_event",
           "read_events", "revert", "revisions"]
