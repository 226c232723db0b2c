"""Verification of draft tokens: greedy gives exactly plain decoding's tokens; sampling uses
standard rejection sampling, which keeps the target distribution.

Accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection sample
from norm(max(0, p_j - q_j)) and stop; if every draft is accepted, sample a bonus token from the
last row. p is the target's distribution after temperature / top-k / top-p / min-p; q the
proposer's (a point mass on d_j for prompt-lookup drafts).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from tallyserve.runner.sampler import apply_top_k_top_p_min_p
from tallyserve.sampling_params import SamplingParams


class TokenSample(NamedTuple):
    token_id: int
    logprob: float  # raw logprob (log_softmax of unmodified logits)
    top_logprobs: Optional[list[tuple[int, float]]]


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of each row under `params` (rows share one request's params)."""
    scaled = logits.float() / params.temperature
    n, vocab = scaled.shape
    dev = scaled.device
    top_k = torch.full((n,), params.top_k, device=dev) if 0 < params.top_k < vocab else None
    top_p = torch.full((n,), params.top_p, device=dev) if params.top_p < 1.0 else None
    min_p = torch.full((n,), params.min_p, device=dev) if params.min_p > 0.0 else None
    if top_k is not None or top_p is not None or min_p is not None:
        scaled = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    return scaled.softmax(dim=-1)


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: Optional[torch.Tensor] = None,
) -> list[TokenSample]:
    """logits: (k + 1, V) target rows for [last token, d_1 .. d_k]. Returns accepted drafts + one."""
    k = len(drafts)
    if params.is_greedy:
        target = logits.argmax(dim=-1).tolist()
        tokens = []
        for j in range(k):
            tokens.append(target[j])
            if target[j] != drafts[j]:
                break
        else:
            tokens.append(target[k])
    else:
        tokens = _rejection_sample(logits, drafts, params, generator, draft_probs)
    return _with_logprobs(logits, tokens, params)


def _rejection_sample(logits, drafts, params, generator, draft_probs) -> list[int]:
    p = processed_probs(logits, params)
    k = len(drafts)
    u = torch.rand(k, generator=generator, device=logits.device).tolist()
    tokens = []
    for j, d in enumerate(drafts):
        p_d = float(p[j, d])
        q_d = float(draft_probs[j, d]) if draft_probs is not None else 1.0
        if q_d > 0 and u[j] < min(1.0, p_d / q_d):
            tokens.append(d)
            continue
        if draft_probs is not None:
            residual = (p[j] - draft_probs[j]).clamp_min(0)
        else:
            residual = p[j].clone()
            residual[d] = 0.0
        if float(residual.sum()) <= 0:
            residual = p[j]
        tokens.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return tokens


def _with_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[TokenSample]:
    rows = logits[: len(tokens)].float()
    logprobs = rows.log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=rows.device).unsqueeze(1)).squeeze(1).tolist()
    tops: list[Optional[list[tuple[int, float]]]] = [None] * len(tokens)
    if params.logprobs:
        k = min(params.logprobs, rows.shape[1])
        values, ids = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenSample(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]
