"""SpecDecodeRunner: proposes draft tokens after each step for the next one.

Drafts go to the scheduler (`set_draft_tokens`), which charges `1 + num_draft_tokens` through the
ledger and trims drafts to the budget; the engine verifies them with the rejection sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.engine.core import DraftSource
from tallyserve.request import Request, RequestStatus
from tallyserve.config.speculative import SpeculativeConfig
from tallyserve.spec_decode.draft_model import DraftModelProposer, DraftRequest
from tallyserve.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from tallyserve.executor.resolve import ResolvedEngine
    from tallyserve.core.scheduler import Scheduler
    from tallyserve.structured_output.manager import StructuredOutputManager


class SpecDecodeRunner(DraftSource):
    """Proposes drafts after each step (through the scheduler it is given) and hands the engine
    core the proposal distributions of the drafts a step verifies."""

    def __init__(self, config: SpeculativeConfig, scheduler: "Scheduler",
                 ngram: Optional[NgramProposer], draft: Optional[DraftModelProposer],
                 structured: Optional["StructuredOutputManager"] = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.ngram = ngram
        self.draft = draft
        self._probs: dict[str, torch.Tensor] = {}
        # Structured outputs: drafts are cut at the first token a request's grammar rejects, before
        # the scheduler charges them.
        self.structured = structured

    @classmethod
    def create(cls, target: "ResolvedEngine", scheduler: "Scheduler", num_blocks: int,
               structured: Optional["StructuredOutputManager"] = None) -> "SpecDecodeRunner":
        cfg: SpeculativeConfig = target.args.speculative_config
        if cfg.method == "ngram":
            return cls(cfg, scheduler, NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                                     cfg.prompt_lookup_max), None, structured)
        return cls(cfg, scheduler, None, DraftModelProposer.load(cfg, target, num_blocks), structured)

    def draft_probs_for(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Proposal distributions of the drafts ``so`` verifies (none for n-grams: point masses)."""
        out = {}
        for e in so.requests:
            if e.num_draft_tokens:
                probs = self.draft_probs(e.request_id, e.num_draft_tokens)
                if probs is not None:
                    out[e.request_id] = probs
        return out

    def draft_probs(self, request_id: str, num_drafts: int) -> Optional[torch.Tensor]:
        """Proposal distributions of the drafts being verified (None: point masses, as for n-grams)."""
        probs = self._probs.pop(request_id, None)
        return None if probs is None else probs[:num_drafts]

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)

    def after_step(self, so: SchedulerOutput, finished: list[Request]) -> None:
        for rid in so.preempted_request_ids:
            self.forget(rid)
        for req in finished:
            self.forget(req.request_id)
        sched = self.scheduler
        ready = []
        for entry in so.requests:
            req = sched.requests.get(entry.request_id)
            if entry.sample and req is not None and req.status == RequestStatus.RUNNING:
                if req.num_computed_tokens == req.num_tokens - 1:
                    ready.append(req)
        if self.ngram is not None:
            for req in ready:
                drafts = self._grammar_prefix(req, self.ngram.propose(req.all_token_ids))
                sched.set_draft_tokens(req.request_id, drafts)
            return
        k = self.config.num_speculative_tokens
        batch = [
            DraftRequest(r.request_id, r.all_token_ids, sched.kv.block_ids(r.request_id), r.sampling_params)
            for r in ready
            if sched.reserve_lookahead(r.request_id, k)  # the draft writes its KV into these slots
        ]
        for rid, (drafts, probs) in self.draft.propose(batch).items():
            req = sched.requests.get(rid)
            if req is not None:
                drafts = self._grammar_prefix(req, drafts)
            sched.set_draft_tokens(rid, drafts)
            self._probs[rid] = probs[:len(drafts)]

    def _grammar_prefix(self, req: Request, drafts: list[int]) -> list[int]:
        """The drafts the request's grammar accepts (all of them without a grammar)."""
        if self.structured is None or not drafts or not self.structured.has(req.request_id):
            return drafts
        return self.structured.trim_drafts(req, drafts)
