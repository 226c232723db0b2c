"""What the async engine raises to its callers (the server maps each to an HTTP status), and the
faults a test may inject into its loop."""

from __future__ import annotations

import enum


class EngineDeadError(RuntimeError):
    """The loop thread is gone (or stopped); the request cannot be served."""


class RequestRejectedError(ValueError):
    """The engine refused the request (bad prompt, duplicate id, ...): a client error."""


class QueueFullError(RuntimeError):
    """More requests wait than max_queue_len allows."""


class StepFailedError(RuntimeError):
    """An engine step failed; the request ended with finish_reason "error"."""


class FaultKind(str, enum.Enum):
    STEP_EXCEPTION = "step_exception"
    KILL_LOOP = "kill_loop"
    STALL = "stall"
