"""vLLM's partial prefill knobs: how many requests may be mid-prefill at once
(max_num_partial_prefills), how many of them long (max_long_partial_prefills), and when a prefill is
long and its chunk capped (long_prefill_token_threshold). They only size chunks and gate admission;
the charge is still the ledger's, and with the defaults the policy is off (`enabled` is False).

A request is *mid-prefill* while more than one of its tokens lacks KV once this step's chunk is
counted (one missing token is just its next decode row). It is *long* in a step when, as the step
begins (for a waiting request: after its committed prefix hit), more than
long_prefill_token_threshold of its tokens lack KV; it stays long for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tallyserve.config import SchedulerConfig
from tallyserve.core import ledger
from tallyserve.request import Request

# admission answers besides a chunk size (> 0) or 0 (no room: stop admitting this step)
SKIP_LONG = -1  # long, and max_long_partial_prefills long prefills already run: try the next one
PARTIAL_FULL = -2  # it would stay mid-prefill and max_num_partial_prefills are: stop admitting


def tokens_left(req: Request, computed: int) -> int:
    """Tokens of ``req`` still lacking KV with ``computed`` computed: the ledger's count without drafts."""
    return ledger.query_tokens(req.num_tokens, computed)


@dataclass
class PrefillSlots:
    """Concurrent partial prefills in the step being scheduled."""

    partial: int  # mid-prefill after this step
    long: int  # long in this step


class PartialPrefillPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.threshold = config.long_prefill_token_threshold
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.enabled = self.max_partial > 1 or self.threshold > 0

    def is_long(self, req: Request, computed: int) -> bool:
        return 0 < self.threshold < tokens_left(req, computed)

    def chunk_budget(self, req: Request, computed: int, budget: int) -> int:
        """The budget a chunk may take: the step's, or for a long prefill at most the threshold."""
        return min(budget, self.threshold) if self.is_long(req, computed) else budget

    def slots(self, running: Iterable[Request], scheduled: dict[str, int]) -> PrefillSlots:
        """Partial prefills among the running requests once the running loop has scheduled them."""
        partial = long = 0
        for req in running:
            left = tokens_left(req, req.num_computed_tokens)
            partial += left - scheduled.get(req.request_id, 0) > 1
            long += 0 < self.threshold < left
        return PrefillSlots(partial, long)
