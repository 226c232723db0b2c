"""Beam search on the engine's own scheduler: every beam is a request, charged one token per
step through the ledger (beam_width per group), sharing its parent's KV blocks by reference with
copy-on-write for the partially filled last block.

Selection follows Hugging Face `generate(num_beams=...)`: keep the top max(2, 1 + #eos) * width
continuations; those that end (EOS or the length limit) within the top `width` become finished
hypotheses scored cum_logprob / generated_len ** length_penalty; the best `width` others run on.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from tallyserve.config import check_prompt_length
from tallyserve.request import RequestStatus
from tallyserve.sampling_params import SamplingParams
from tallyserve.request import Request

if TYPE_CHECKING:
    from tallyserve.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

_NEG = -1.0e9
# |length_penalty| bound: generated_len ** length_penalty stays a finite, non-zero float for any
# length up to 2**64 (HF's typical values are 0-2; vLLM's default is 1).
MAX_ABS_LENGTH_PENALTY = 10.0


class NoRoomForBeams(Exception):
    """The pool lacks the copy-on-write blocks a step's forks need (retried after other work)."""


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("beam_width", 1), ("max_tokens", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search is deterministic: temperature must be 0")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise ValueError(f"length_penalty must be a number, got {lp!r}")
        if not (math.isfinite(lp) and abs(lp) <= MAX_ABS_LENGTH_PENALTY):
            raise ValueError(f"length_penalty must be a finite number in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                             f"{MAX_ABS_LENGTH_PENALTY:g}], got {lp}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as vLLM returns them
    text: Optional[str]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    request_id: str
    sequences: list[BeamSearchSequence]  # best first
    error: Optional[str] = None  # why the search ended without sequences


@dataclass
class _Beam:
    request_id: str
    generated: list[int]
    cum_logprob: float


@dataclass
class BeamGroup:
    group_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    running: list[_Beam]
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, generated, cum)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # beam request id -> logprobs (V,)
    num_generated: int = 0
    heuristic_open: bool = True
    done: bool = False
    forked: list[str] = field(default_factory=list)  # forks of the reassign under way (freed on failure)
    _ids: itertools.count = field(default_factory=itertools.count)

    def ready(self) -> bool:
        return all(b.request_id in self.rows for b in self.running)

    def advance(self, scheduler: "Scheduler") -> None:
        """All beams have their next-token logprobs: select, fork, extend, free."""
        p, width = self.params, self.params.beam_width
        eos = () if p.ignore_eos else self.eos_token_ids
        keep = max(2, 1 + len(eos)) * width
        scores = torch.stack([self.rows[b.request_id] + b.cum_logprob for b in self.running]).reshape(-1)
        vocab = scores.numel() // len(self.running)
        top_scores, top_idx = torch.topk(scores, k=min(keep, scores.numel()))
        cands = [(float(s), int(i) // vocab, int(i) % vocab) for s, i in zip(top_scores, top_idx)]
        last = self.num_generated + 1 >= p.max_tokens
        ends = [last or tok in eos for _, _, tok in cands]
        order = sorted(range(len(cands)), key=lambda r: -(cands[r][0] + (_NEG if ends[r] else 0.0)))
        chosen = [(cands[r][1], cands[r][2], cands[r][0] + (_NEG if ends[r] else 0.0)) for r in order[:width]]
        saved = (list(self.finished), self.heuristic_open)
        self._add_finished(cands, ends, width)
        if all(ends) or self._heuristic_says_stop(chosen):
            self.num_generated += 1
            self._finish(scheduler)
            return
        if self._blocks_needed(scheduler, chosen) > scheduler.kv.num_free_blocks:
            self.finished, self.heuristic_open = saved  # nothing changed: try again after a step
            raise NoRoomForBeams()
        self.num_generated += 1
        self._reassign(scheduler, chosen)

    def _blocks_needed(self, scheduler: "Scheduler", chosen) -> int:
        """Free blocks the forks need: one copy-on-write block per fork of a partially filled parent."""
        seen, need = set(), 0
        for beam, _, _ in chosen:
            if beam in seen:
                parent = scheduler.requests[self.running[beam].request_id]
                if parent.status == RequestStatus.RUNNING and parent.num_computed_tokens % scheduler.kv.block_size:
                    need += 1
            seen.add(beam)
        return need

    def _add_finished(self, cands, ends, width: int) -> None:
        if not self.heuristic_open:
            return
        gen_len = self.num_generated + 1
        new = []
        for rank, ((score, beam, tok), end) in enumerate(zip(cands, ends)):
            if end and rank < width:
                b = self.running[beam]
                new.append((score / (gen_len ** self.params.length_penalty), b.generated + [tok], score))
        merged = self.finished + new
        # Stable: existing hypotheses win ties, as in a top-k over [finished, new].
        self.finished = sorted(merged, key=lambda h: -h[0])[:width]

    def _heuristic_says_stop(self, chosen) -> bool:
        """Hugging Face's default (early_stopping=False) test: can the best running beam still win?"""
        if len(self.finished) < self.params.beam_width:
            return False
        # the chosen candidates already hold this step's token: num_generated + 1 tokens (as Hugging
        # Face's cur_len + 1); num_generated alone is 0 on the first step, and 0 ** -lp divides by zero
        best_running = max(s for _, _, s in chosen) / ((self.num_generated + 1) ** self.params.length_penalty)
        if best_running > min(h[0] for h in self.finished):
            return False
        self.heuristic_open = False
        return True

    def _reassign(self, scheduler: "Scheduler", chosen) -> None:
        """New running beams, in score order. A parent continues in place in the first slot that
        extends it; every other slot extending it is a fork (made before the parent moves on)."""
        first_slot: dict[int, int] = {}
        for slot, (beam, _, _) in enumerate(chosen):
            first_slot.setdefault(beam, slot)
        new_running: list[Optional[_Beam]] = [None] * len(chosen)
        for slot, (beam, tok, score) in enumerate(chosen):
            if first_slot[beam] != slot:
                parent = self.running[beam]
                child_id = f"{self.group_id}#b{next(self._ids)}"
                self.forked.append(child_id)
                child = scheduler.fork_request(parent.request_id, child_id)
                scheduler.append_token(child.request_id, tok)
                new_running[slot] = _Beam(child.request_id, parent.generated + [tok], score)
        for beam, slot in first_slot.items():
            _, tok, score = chosen[slot]
            parent = self.running[beam]
            scheduler.append_token(parent.request_id, tok)
            new_running[slot] = _Beam(parent.request_id, parent.generated + [tok], score)
        dropped = [b.request_id for i, b in enumerate(self.running) if i not in first_slot]
        scheduler.finish_requests(dropped, RequestStatus.FINISHED_ABORTED)
        self.running = new_running
        self.rows.clear()
        self.forked.clear()

    def _finish(self, scheduler: "Scheduler") -> None:
        scheduler.finish_requests([b.request_id for b in self.running], RequestStatus.FINISHED_STOPPED)
        self.running = []
        self.rows.clear()
        self.done = True

    def output(self, tokenizer) -> BeamSearchOutput:
        eos = () if self.params.ignore_eos else self.eos_token_ids
        seqs = []
        for score, gen, cum in self.finished:
            text = None
            if tokenizer is not None:
                text = tokenizer.decode(gen, skip_special_tokens=not self.params.include_stop_str_in_output)
            reason = "stop" if gen and gen[-1] in eos else "length"
            seqs.append(BeamSearchSequence(self.prompt_token_ids + gen, text, cum, score, reason))
        return BeamSearchOutput(self.group_id, seqs)


class BeamSearchDriver:
    """Engine glue: owns the groups, feeds them logprob rows, advances them between steps."""

    def __init__(self, scheduler: "Scheduler", tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.groups: dict[str, BeamGroup] = {}
        self._owner: dict[str, BeamGroup] = {}
        self.outputs: dict[str, BeamSearchOutput] = {}

    def add(self, group_id: str, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        if group_id in self.groups or group_id in self.outputs:
            raise ValueError(f"request id {group_id!r} is already in use")
        check_prompt_length(len(prompt_token_ids), self.scheduler.config.max_model_len, params.max_tokens)
        sp = SamplingParams(max_tokens=params.max_tokens, temperature=0.0)
        root = Request(f"{group_id}#root", prompt_token_ids, sp, max_tokens=params.max_tokens,
                       eos_token_ids=self.eos_token_ids)
        root.beam_search = True
        self.scheduler.add_request(root)
        group = BeamGroup(group_id, list(prompt_token_ids), params, self.eos_token_ids, [_Beam(root.request_id, [], 0.0)])
        self.groups[group_id] = group
        self._owner[root.request_id] = group

    def owns(self, request_id: str) -> bool:
        return request_id in self._owner

    def record(self, request_id: str, logprobs: torch.Tensor) -> None:
        """A beam's next-token log-probabilities (the runner's log_softmax of its logits row)."""
        group = self._owner.get(request_id)
        if group is not None:
            group.rows[request_id] = logprobs

    def after_step(self, progressed: bool = True) -> None:
        """Advance every group whose beams all reported. A group whose forks find no free block
        waits while other requests make progress (they free blocks), and fails otherwise."""
        for gid, group in list(self.groups.items()):
            if group.running and group.ready():
                before = {b.request_id for b in group.running}
                try:
                    group.advance(self.scheduler)
                except NoRoomForBeams:
                    others = any(r.request_id not in self._owner for r in self.scheduler.running)
                    if not (others and progressed):
                        self._end(group, RequestStatus.FINISHED_ERROR,
                                  "the KV cache has no free block for the beams; lower beam_width or add memory")
                    continue
                except Exception as exc:  # noqa: BLE001 - one group's failure ends that group only
                    logger.error("beam search group %s failed", gid, exc_info=exc)
                    self._end(group, RequestStatus.FINISHED_ERROR, f"beam search failed: {type(exc).__name__}: {exc}")
                    continue
                for rid in before - {b.request_id for b in group.running}:
                    self._owner.pop(rid, None)
                for b in group.running:
                    self._owner[b.request_id] = group
            if group.done:
                self.outputs[gid] = group.output(self.tokenizer)
                del self.groups[gid]

    def fail(self, request_id: str, error: str) -> None:
        """A beam's step failed: the whole group ends with no sequences."""
        group = self._owner.get(request_id)
        if group is not None and group.group_id in self.groups:
            self._end(group, RequestStatus.FINISHED_ERROR, error)

    def fail_all(self, error: str) -> None:
        """End every running group with `error` (the engine's last-resort recovery)."""
        for group in list(self.groups.values()):
            self._end(group, RequestStatus.FINISHED_ERROR, error)

    def abort(self, group_id: str) -> bool:
        """End a running group (client gone, shutdown), freeing its blocks. False if unknown."""
        group = self.groups.get(group_id)
        if group is None:
            return False
        self._end(group, RequestStatus.FINISHED_ABORTED, None)
        self.outputs.pop(group_id, None)
        return True

    def _end(self, group: BeamGroup, status: RequestStatus, error: Optional[str]) -> None:
        ids = [b.request_id for b in group.running if b is not None] + group.forked
        self.scheduler.finish_requests(ids, status)
        for rid in ids:
            self._owner.pop(rid, None)
        group.forked.clear()
        del self.groups[group.group_id]
        self.outputs[group.group_id] = BeamSearchOutput(group.group_id, [], error)
