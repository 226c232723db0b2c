"""Prompt logprobs (vLLM's ``prompt_logprobs``): the raw model distribution at prompt positions.

A prefill chunk's row at position p scores the prompt token at p + 1. Only the rows a
ScheduledRequest names (``prompt_logprob_targets``) are turned into logits, in slices of at most
``SLICE_ELEMENTS`` logits, so a chunk of thousands of tokens over a large vocabulary never holds
its whole (tokens x vocab) float32 matrix: per slice, the logits, their logsumexp, the target's
logprob and full-vocabulary rank, and the top-k. Every tensor-parallel rank runs the same slices
(the logits are gathered onto rank 0); only rank 0 gets a result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from tallyserve.core.sched_output import ScheduledRequest

# Logits elements per slice: 16 Mi float32 = 64 MiB (341 rows of a 49k vocabulary).
SLICE_ELEMENTS = 1 << 24


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs from one step, on the host. Row i scores the prompt token at
    index ``first_index + i``: its logprob, its rank in the whole vocabulary (1 = most likely), and
    the ``k`` most likely tokens there with their logprobs (descending)."""

    first_index: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class _Span:
    request_id: str
    first_index: int
    offset: int  # into the packed rows
    count: int
    k: int


@dataclass
class PendingPromptLogprobs:
    """A step's prompt logprobs, possibly still on the device; ``result()`` copies them to the host."""

    spans: list[_Span]
    targets: list[int]
    logprobs: torch.Tensor  # (R,) float32
    ranks: torch.Tensor  # (R,) int64
    top_logprobs: torch.Tensor  # (R, K) float32
    top_ids: torch.Tensor  # (R, K) int64

    def result(self) -> dict[str, PromptLogprobs]:
        lps, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_lps, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        out = {}
        for s in self.spans:
            rows = slice(s.offset, s.offset + s.count)
            out[s.request_id] = PromptLogprobs(
                s.first_index, self.targets[rows], lps[rows], ranks[rows],
                [r[:s.k] for r in top_ids[rows]], [r[:s.k] for r in top_lps[rows]])
        return out


def plan(requests: Sequence[ScheduledRequest], query_start_loc: Sequence[int]) -> tuple[list[_Span], list[int], list[int]]:
    """The spans of a step's requests with prompt-logprob rows, their rows in the batch and targets."""
    spans, rows, targets = [], [], []
    for i, e in enumerate(requests):
        n = len(e.prompt_logprob_targets)
        if not n:
            continue
        spans.append(_Span(e.request_id, e.start_position + 1, len(rows), n, e.sampling_params.prompt_logprobs))
        start = query_start_loc[i]
        rows.extend(range(start, start + n))
        targets.extend(e.prompt_logprob_targets)
    return spans, rows, targets


@torch.inference_mode()
def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], Optional[torch.Tensor]], hidden: torch.Tensor,
                            requests: Sequence[ScheduledRequest], query_start_loc: Sequence[int],
                            vocab_size: int) -> Optional[PendingPromptLogprobs]:
    """Prompt logprobs of a step's rows that ask for them (None if none do, or on a tensor-parallel
    rank other than 0). ``compute_logits``: hidden rows -> float32 logits (None off rank 0)."""
    spans, rows, targets = plan(requests, query_start_loc)
    if not spans:
        return None
    device = hidden.device
    k_max = max(s.k for s in spans)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    targets_t = torch.tensor(targets, dtype=torch.int64, device=device)
    per_slice = max(1, SLICE_ELEMENTS // max(vocab_size, 1))
    lps, ranks, top_lps, top_ids = [], [], [], []
    for lo in range(0, len(rows), per_slice):
        logits = compute_logits(hidden[rows_t[lo:lo + per_slice]])
        if logits is None:  # another rank gets them
            continue
        logits = logits.float()
        target = logits.gather(1, targets_t[lo:lo + per_slice, None])  # (r, 1)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        lps.append((target - lse).squeeze(1))
        ranks.append((logits > target).sum(dim=-1) + 1)
        if k_max:
            values, ids = logits.topk(k_max, dim=-1)
            top_lps.append(values - lse)
            top_ids.append(ids)
        del logits
    if not lps:
        return None
    if k_max:
        top_lp_t, top_id_t = torch.cat(top_lps), torch.cat(top_ids)
    else:
        top_lp_t = torch.zeros((len(rows), 0), dtype=torch.float32, device=device)
        top_id_t = torch.zeros((len(rows), 0), dtype=torch.int64, device=device)
    return PendingPromptLogprobs(spans, targets, torch.cat(lps), torch.cat(ranks), top_lp_t, top_id_t)
