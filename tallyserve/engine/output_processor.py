"""Turns sampled tokens into user-visible outputs: detokenization, stop strings, logprobs, n > 1."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tallyserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tallyserve.request import Request
from tallyserve.runner.prompt_logprobs import PromptLogprobs as PromptLogprobRows
from tallyserve.runner.rejection_sampler import TokenSample
from tallyserve.sampling_params import SamplingParams
from tallyserve.detokenizer import IncrementalDetokenizer
from tallyserve.tokenizer import Tokenizer


@dataclass
class SequenceState:
    """Engine-side state of one sequence (one of a request's n completions)."""

    request: Request
    index: int
    parent_id: str
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: float = 0.0  # summed only when the request asks logprobs (reported only then)
    num_emitted: int = 0  # output tokens already detokenized and reported
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[SequenceState] = field(default_factory=list)
    error: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    # params.prompt_logprobs: filled by prompt index as the prefill chunks compute them (the first child's)
    prompt_logprobs: Optional[PromptLogprobs] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def to_output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=c.request.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if self.params.logprobs is not None else None,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,  # a snapshot
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in self.children
        ]
        cached = self.children[0].request.num_cached_tokens if self.children else 0
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=max(cached, 0),
            error=self.error,
            metrics=dict(self.metrics),
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer_params=self.children[0].request.kv_transfer_output if self.children else None,
        )


def make_detokenizer(tokenizer: Optional[Tokenizer], request: Request) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.sampling_params)


def record_logprobs(seq: SequenceState, sample: TokenSample, tokenizer: Optional[Tokenizer]) -> None:
    """Add one sampled token's logprob entry, and its logprob to the cumulative one; nothing when
    the request asks no logprobs (its cumulative_logprob is reported only with them)."""
    if seq.request.sampling_params.logprobs is None:
        return
    seq.cumulative_logprob += sample.logprob
    top = sample.top_logprobs or []
    rank = next((i for i, (t, _) in enumerate(top, 1) if t == sample.token_id), None)
    entry = {sample.token_id: Logprob(sample.logprob, rank, _piece(tokenizer, sample.token_id))}
    for r, (tid, lp) in enumerate(top, start=1):
        entry.setdefault(tid, Logprob(lp, r, _piece(tokenizer, tid)))
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(entry)


def record_prompt_logprobs(parent: ParentState, rows: PromptLogprobRows, tokenizer: Optional[Tokenizer]) -> None:
    """Store one step's prompt logprob rows at their prompt indices. A prompt index computed again
    (a request preempted before its first token recomputes its prompt) is overwritten, never
    appended, so no entry is duplicated or lost."""
    if parent.prompt_logprobs is None:
        parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
    pieces: dict[int, Optional[str]] = {}

    def piece(tid: int) -> Optional[str]:
        if tid not in pieces:
            pieces[tid] = _piece(tokenizer, tid)
        return pieces[tid]

    for i, tid in enumerate(rows.token_ids):
        entry = {tid: Logprob(rows.logprobs[i], rows.ranks[i], piece(tid))}
        for rank, (other, lp) in enumerate(zip(rows.top_ids[i], rows.top_logprobs[i]), start=1):
            entry.setdefault(other, Logprob(lp, rank, piece(other)))
        parent.prompt_logprobs[rows.first_index + i] = entry


def _piece(tokenizer: Optional[Tokenizer], token_id: int) -> Optional[str]:
    return None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)
