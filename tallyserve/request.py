"""Request: the scheduler's record of one sequence.

There is no phase in state: a request has `num_tokens` (prompt + output so far) and
`num_computed_tokens` (tokens whose KV is in the cache); prefill and decode are derived.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from tallyserve.sampling_params import SamplingParams

_arrival_counter = itertools.count()

# Stands in all_token_ids for a token an in-flight step is still sampling (async scheduling).
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    # Admitted with its prompt KV coming from another instance (disaggregated serving): its blocks
    # are allocated and committed, the load runs outside the token budget (vLLM's name).
    WAITING_FOR_REMOTE_KVS = 7

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence. Owned by the scheduler; the runner only ever sees a SchedulerOutput."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: "SamplingParams",
        *,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_counter)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: Optional[str] = None
        # Chained hashes of the full blocks of all_token_ids (kept by the KV cache manager).
        self.block_hashes: list[int] = []
        # Prompt tokens served from the prefix cache at first admission (-1: not yet admitted).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Draft tokens proposed for the next step (speculative decoding); verified, never trusted.
        self.spec_token_ids: list[int] = []
        # Trailing PLACEHOLDER_TOKEN_IDs: tokens of in-flight steps, not sampled yet (async scheduling).
        self.num_output_placeholders = 0
        # A beam of a beam search group: its rows return logprobs, the engine picks its tokens.
        self.beam_search = False
        # Disaggregated serving (vLLM's name): do_remote_prefill (load this prompt's KV from the
        # producer named here) or do_remote_decode (hold the KV for a consumer to pull).
        self.kv_transfer_params: Optional[dict] = None
        self.kv_transfer_output: Optional[dict] = None  # a producer's params for the consumer, once finished

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far, in-flight placeholders included (they count toward max_tokens)."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens known on the host: all of them but the trailing placeholders."""
        return len(self.all_token_ids) - self.num_output_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        """The sampled output tokens (placeholders of in-flight steps excluded)."""
        return self.all_token_ids[len(self.prompt_token_ids):self.num_resolved_tokens]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower sorts first: priority, then arrival order (FCFS)."""
        return (self.priority, self.arrival_seq)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
