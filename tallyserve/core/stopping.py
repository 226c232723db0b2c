"""When a request ends: its length limits (max_tokens, max_model_len) and the stop conditions a
just-sampled token meets (EOS, stop_token_ids, past min_tokens). Stop strings are matched on text by
the engine's output processor; these are the token-level ones the scheduler applies."""

from __future__ import annotations

from typing import Optional

from tallyserve.request import Request, RequestStatus


def ends_by_length(req: Request, length: int, max_model_len: int) -> bool:
    """Does a sequence of ``length`` tokens reach max_tokens or max_model_len?"""
    return length - req.num_prompt_tokens >= req.max_tokens or length >= max_model_len


def check_stop(req: Request, length: int, max_model_len: int) -> Optional[RequestStatus]:
    """Does the token at ``length - 1`` (just sampled) end the request? Sets ``stop_reason`` for a
    stop token id."""
    sp, last = req.sampling_params, req.all_token_ids[length - 1]
    if length - req.num_prompt_tokens >= sp.min_tokens:
        if not sp.ignore_eos and last in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in sp.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if ends_by_length(req, length, max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
