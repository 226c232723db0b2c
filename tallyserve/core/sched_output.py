"""SchedulerOutput: the one frozen contract from the scheduler to the runner (ledger rule 4).

The batch builder, KV transfers and metrics all read this same object; nothing downstream
mutates a Request. Results return through `Scheduler.update(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from tallyserve.core.kv_cache_manager import KVTransfers

if TYPE_CHECKING:
    from tallyserve.request import Request
    from tallyserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class GrammarBitmask:
    """The bitmask rows of one step: for each request id in ``request_ids`` (in the step's order),
    ``num_sample_rows`` consecutive rows of ``bitmask`` (int32, host memory)."""

    request_ids: frozenset[str]
    bitmask: torch.Tensor  # (rows, ceil(vocab / 32)) int32


class ScheduledRequest(NamedTuple):
    """One request's share of a step (a NamedTuple: immutable and cheap to build per step)."""

    request_id: str
    token_ids: tuple[int, ...]  # the input ids computed this step (draft tokens last)
    start_position: int  # tokens already in the KV cache (positions start here)
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool  # this step reaches the end of the sequence: sample a token from its last row
    sampling_params: "SamplingParams"
    num_output_tokens: int  # tokens generated so far (seeds and min_tokens depend on it)
    num_draft_tokens: int = 0  # trailing token_ids that are drafts to verify (sample=True then)
    beam_search: bool = False  # a beam: the runner returns its row's logprobs instead of sampling
    # prompt_logprobs: the prompt token each leading row scores (row i, at position start_position + i,
    # predicts the token at start_position + i + 1); empty for requests without prompt_logprobs
    prompt_logprob_targets: tuple[int, ...] = ()

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else ()

    @property
    def num_sample_rows(self) -> int:
        """Rows whose logits are needed: the last one, plus one per draft token."""
        return 1 + self.num_draft_tokens if self.sample else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def prompt_logprob_targets(req: "Request", start: int, num_real: int) -> tuple[int, ...]:
    """The prompt tokens scored by the rows of a chunk of ``num_real`` tokens from ``start``: every
    row up to the second-to-last prompt position, for a request with prompt_logprobs that has no
    output token yet (one recomputing its prompt after a preemption scored it already)."""
    if req.sampling_params.prompt_logprobs is None or req.num_output_tokens:
        return ()
    end = min(start + num_real, req.num_prompt_tokens - 1)
    return tuple(req.prompt_token_ids[start + 1:end + 1]) if end > start else ()
class RemoteKVLoad(NamedTuple):
    """A remote prefix hit committed this step (disaggregated serving): the request's blocks
    ``block_ids`` are allocated and will receive ``num_tokens`` tokens of KV (positions from
    ``start_position``) from the producer's blocks ``remote_block_ids``. No token is charged."""

    request_id: str
    block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    start_position: int
    num_tokens: int
    params: dict  # the request's kv_transfer_params (remote engine, address, request id)


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    requests: tuple[ScheduledRequest, ...]
    total_tokens: int  # what the ledger charged: the sum of every request's num_tokens
    kv_transfers: KVTransfers = KVTransfers()  # offloads, restores, partial copies: before the forward
    preempted_request_ids: tuple[str, ...] = ()
    max_num_batched_tokens: int = 0
    # Scheduled before the previous step's results were in: requests were advanced at schedule
    # time and input tokens equal to PLACEHOLDER_TOKEN_ID come from that step's sampled tokens.
    async_scheduled: bool = False
    # Requests that finished since the previous step: the runner drops their per-request state
    # (seeded generators) before this step's rows, so a reused id starts fresh.
    finished_request_ids: tuple[str, ...] = ()
    # Structured outputs: token bitmask rows of the entries with a grammar (attached by the engine
    # core after the ledger check; they change which tokens are sampled, never how many are computed).
    grammar_bitmask: Optional["GrammarBitmask"] = None
    # Disaggregated serving: the remote loads committed in this step (and only those), and what
    # the KV connector built from this very output for its workers (vLLM's name).
    kv_loads: tuple[RemoteKVLoad, ...] = ()
    kv_releases: tuple[dict, ...] = ()  # remote KV this step chose not to load: its producer may free it
    kv_connector_metadata: Optional[Any] = None

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_requests(self) -> int:
        return len(self.requests)
