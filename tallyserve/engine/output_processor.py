"""OutputProcessor: sampled tokens into user-visible outputs (detokenization, stop strings, logprobs, n > 1)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from tallyserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tallyserve.request import Request, RequestStatus
from tallyserve.runner.prompt_logprobs import PromptLogprobs as PromptLogprobRows
from tallyserve.runner.rejection_sampler import TokenSample
from tallyserve.sampling_params import SamplingParams
from tallyserve.detokenizer import IncrementalDetokenizer
from tallyserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tallyserve.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


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


class OutputProcessor:
    """The engine core's per-request output state: each request's sequences, their detokenizers and
    stop strings, logprobs, and the RequestOutputs of the requests that progressed.

    It decides one kind of stop, the stop string (the detokenizer finds it), and tells the scheduler
    (``Scheduler.stop_request``), which stops the sequence's blocks and tokens at once. Every other end is
    decided elsewhere and only recorded here (`finish`): EOS, stop token ids and length in the scheduler
    (core/stopping.py), a grammar's end by the StructuredOutputManager, a failed step by EngineCore, an
    abort by the caller. ``on_end(request_id)`` runs once per ended sequence (the engine forgets its
    grammar matcher and its drafts)."""

    def __init__(self, tokenizer: Optional[Tokenizer], scheduler: "Scheduler",
                 on_end: Callable[[str], None], final_outputs_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.on_end = on_end
        self.parents: dict[str, ParentState] = {}
        self.seqs: dict[str, SequenceState] = {}
        self.pending: list[RequestOutput] = []  # outputs of requests ended outside a step
        # Offline callers that only want finished outputs skip building the rest every step.
        self.final_outputs_only = final_outputs_only

    def add(self, parent: ParentState) -> None:
        for seq in parent.children:
            self.seqs[seq.request.request_id] = seq
        self.parents[parent.request_id] = parent

    def seq_of(self, request: Request) -> Optional[SequenceState]:
        """The sequence of this very Request (None for another one reusing the id, or an ended one)."""
        seq = self.seqs.get(request.request_id)
        return seq if seq is not None and seq.request is request else None

    def take_pending(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    # ----------------------------------------------------------------- tokens
    def emit(self, seq: SequenceState, samples: list[TokenSample]) -> None:
        """Logprobs and stop-safe text for the tokens the scheduler appended this step; a stop string
        stops the sequence (here, the one place that decides it)."""
        req = seq.request
        detok = seq.detokenizer
        # The sampled tokens not yet emitted (no placeholders): one slice, not output_token_ids'
        # copy of every output token.
        new = req.all_token_ids[req.num_prompt_tokens + seq.num_emitted:req.num_resolved_tokens]
        logprobs = req.sampling_params.logprobs is not None  # nothing to record otherwise
        for i, token in enumerate(new):
            if logprobs:
                record_logprobs(seq, samples[i], self.tokenizer)
            seq.num_emitted += 1
            seq.text += detok.update((token,))  # stop-safe text only
            if detok.finished:
                was_finished = req.is_finished()
                self.scheduler.stop_request(req, seq.num_emitted, detok.stop_reason)
                if not was_finished:
                    self.finish(seq, req)
                return

    def prompt_logprobs(self, seq: SequenceState, rows: PromptLogprobRows) -> None:
        record_prompt_logprobs(self.parents[seq.parent_id], rows, self.tokenizer)

    # ----------------------------------------------------------------- ends
    def finish(self, seq: SequenceState, req: Request, flush: bool = True) -> None:
        """Record the end the scheduler gave ``req`` (its status and stop reason) on its sequence."""
        if seq.finish_reason is not None:
            return
        if flush and not seq.detokenizer.finished:
            try:
                seq.detokenizer.flush()
            except Exception as exc:  # noqa: BLE001 - keep the text produced so far
                logger.error("flushing the detokenizer of %s failed", req.request_id, exc_info=exc)
        seq.text = seq.detokenizer.text
        seq.finish_reason = req.status.finish_reason
        seq.stop_reason = req.stop_reason
        self.seqs.pop(req.request_id, None)
        self.on_end(req.request_id)

    def fail(self, seq: SequenceState, msg: str) -> None:
        """End one sequence with an error (its own output processing failed); its blocks are freed."""
        req = seq.request
        if not req.is_finished():
            req.error = msg
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        self.finish(seq, req, flush=False)
        parent = self.parents.get(seq.parent_id)
        if parent is not None:
            parent.error = msg

    def end_unscheduled(self, parent: ParentState, status: RequestStatus, error: Optional[str]) -> None:
        """End a request the scheduler never saw (its grammar failed to compile, or it was aborted
        while it compiled); its output is pending for the next step."""
        for seq in parent.children:
            seq.request.status = status
            seq.request.error = error
            self.finish(seq, seq.request, flush=False)
        parent.error = error
        self.pending.append(self.pop_if_finished(parent))

    def fail_all(self, msg: str, touched: dict[str, ParentState]) -> None:
        for parent in list(self.parents.values()):
            for seq in parent.children:
                if seq.finish_reason is None:
                    self.fail(seq, msg)
            parent.error = msg
            touched[parent.request_id] = parent

    # ----------------------------------------------------------------- outputs
    def collect(self, touched: dict[str, ParentState]) -> list[RequestOutput]:
        """Outputs of the requests that progressed; only the finished ones when nobody streams."""
        if self.final_outputs_only:
            return [self.pop_if_finished(p) for p in touched.values() if p.finished]
        return [self.pop_if_finished(parent) for parent in touched.values()]

    def pop_if_finished(self, parent: ParentState) -> RequestOutput:
        if parent.finished:
            self.parents.pop(parent.request_id, None)
            parent.metrics["finished_time"] = time.time()
        return parent.to_output()
