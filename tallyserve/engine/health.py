"""Engine health: what /health reports, derived from what the engine loop publishes.

The loop is stalled when work is pending and no step completed within the stall window while none
was running, or when the running step has run longer than the stall timeout plus STALL_FACTOR times
its predicted duration (seconds per scheduled token, an average over finished steps, times the
step's tokens): a long prefill that runs at the usual speed is progress, not a stall.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_STALL_TIMEOUT_S = 5.0
SEED_SECONDS_PER_TOKEN = 0.02  # conservative CPU figure, until a finished step gives a measurement
STALL_FACTOR = 8.0  # a running step is stalled past stall_timeout + STALL_FACTOR x its predicted time
EMA_ALPHA = 0.2  # weight of the newest step in the seconds-per-token average
EMA_MAX_JUMP = 4.0  # one step counts as at most this many times the estimate (an injected stall, a GC pause)


@dataclass(frozen=True)
class HealthState:
    alive: bool
    draining: bool
    pending: int
    seconds_since_heartbeat: float
    stall_timeout: float
    dead_reason: Optional[str]
    step_running_s: Optional[float] = None  # how long the running step has run; None between steps
    step_tokens: int = 0  # tokens the running step scheduled (0 if not known)
    seconds_per_token: float = SEED_SECONDS_PER_TOKEN  # the loop's estimate from finished steps

    @property
    def predicted_step_s(self) -> float:
        return self.seconds_per_token * self.step_tokens

    @property
    def step_limit_s(self) -> float:
        """How long the running step may take before it counts as stalled."""
        return self.stall_timeout + STALL_FACTOR * self.predicted_step_s

    @property
    def stalled(self) -> bool:
        if self.step_running_s is not None:
            return self.step_running_s > self.step_limit_s
        return self.pending > 0 and self.seconds_since_heartbeat > self.stall_timeout

    @property
    def healthy(self) -> bool:
        return self.alive and not self.draining and not self.stalled

    @property
    def reason(self) -> str:
        if not self.alive:
            return f"engine loop is not running: {self.dead_reason or 'stopped'}"
        if self.draining:
            return "server is draining for shutdown"
        if self.stalled and self.step_running_s is not None:
            return (f"engine loop stalled: the running step has taken {self.step_running_s:.1f}s, over its limit "
                    f"of {self.step_limit_s:.1f}s (stall timeout {self.stall_timeout}s + {STALL_FACTOR:g} x the "
                    f"predicted {self.predicted_step_s:.3f}s for {self.step_tokens} token(s) at "
                    f"{self.seconds_per_token * 1e3:.3f} ms/token), {self.pending} request(s) pending")
        if self.stalled:
            return (f"engine loop stalled: no step running and none completed for "
                    f"{self.seconds_since_heartbeat:.1f}s with {self.pending} request(s) pending "
                    f"(stall timeout {self.stall_timeout}s)")
        return "ok"


# HealthBoard slots: time.monotonic() is one clock for every process of the host.
HEARTBEAT, STEP_STARTED, STEP_TOKENS, SECONDS_PER_TOKEN = range(4)
HEALTH_SLOTS = 4


class HealthBoard:
    """What the loop publishes for /health, in four float slots with a single writer (the loop):
    a plain list when the loop is a thread of this process, a shared-memory array
    (``multiprocessing.RawArray("d", HEALTH_SLOTS)``) when it runs in the engine core process, so
    the server reads it without asking, also while a step runs. NaN in STEP_STARTED: no step runs."""

    def __init__(self, slots: Any = None) -> None:
        self.slots = slots if slots is not None else [0.0] * HEALTH_SLOTS
        self.slots[HEARTBEAT] = time.monotonic()
        self.slots[STEP_STARTED] = math.nan
        self.slots[STEP_TOKENS] = 0
        self.slots[SECONDS_PER_TOKEN] = SEED_SECONDS_PER_TOKEN

    @property
    def heartbeat(self) -> float:
        return self.slots[HEARTBEAT]

    def beat(self) -> None:
        self.slots[HEARTBEAT] = time.monotonic()

    @property
    def step_started(self) -> Optional[float]:
        v = self.slots[STEP_STARTED]
        return None if math.isnan(v) else v

    def step_begins(self) -> float:
        now = time.monotonic()
        self.slots[STEP_STARTED] = now
        return now

    def step_ends(self) -> None:
        self.slots[STEP_TOKENS] = 0
        self.slots[STEP_STARTED] = math.nan
        self.beat()

    def observe_step(self, seconds: float, tokens: int) -> None:
        """Fold a finished step into the seconds-per-token average the stall rule predicts with.
        One sample moves it up by at most EMA_MAX_JUMP x, so a stalled step barely skews it."""
        spt = self.slots[SECONDS_PER_TOKEN]
        sample = min(seconds / tokens, EMA_MAX_JUMP * spt)
        self.slots[SECONDS_PER_TOKEN] = spt + EMA_ALPHA * (sample - spt)

    @property
    def step_tokens(self) -> int:
        return int(self.slots[STEP_TOKENS])

    @step_tokens.setter
    def step_tokens(self, tokens: int) -> None:
        self.slots[STEP_TOKENS] = tokens

    @property
    def seconds_per_token(self) -> float:
        return self.slots[SECONDS_PER_TOKEN]
