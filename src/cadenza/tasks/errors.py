"""The one error type of cadenza.tasks: bad input or a project we cannot build tasks from."""

from __future__ import annotations


class TaskError(RuntimeError):
    """Says what was expected, what was found, and what to do."""
