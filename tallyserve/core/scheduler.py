"""Scheduler: one token-budget loop. Running requests first, then waiting ones.

Each request catches `num_computed_tokens` up to `num_tokens`; prefill, chunked prefill,
decode, prefix reuse and preemption all fall out of that. Every token charged comes from
`ledger.query_tokens` / `ledger.charge`, after the prefix hit has been committed.

vLLM's partial prefill knobs (max_num_partial_prefills, max_long_partial_prefills,
long_prefill_token_threshold) only size chunks and gate admission (`core/partial_prefill.py`); with
their defaults every decision is today's.
"""

from __future__ import annotations

import bisect
import time
from typing import Iterable, Optional

from tallyserve.config import CacheConfig, SchedulerConfig, check_prompt_length
from tallyserve.core import ledger
from tallyserve.core.kv_cache_manager import KVCacheManager
from tallyserve.core.partial_prefill import PARTIAL_FULL, SKIP_LONG, PartialPrefillPolicy, PrefillSlots, tokens_left
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput, prompt_logprob_targets
from tallyserve.core.stats import SchedulerStats, scheduler_snapshot
from tallyserve.core.stopping import check_stop, ends_by_length
from tallyserve.core.remote_kv import RemoteKVScheduling
from tallyserve.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus


IDLE_CHECK_INTERVAL_S = 5.0

class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_connector=None,
                 grammar_waits: bool = False) -> None:
        self.config = scheduler_config
        self.kv = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.enable_partial_reuse,
            cache_config.num_host_blocks,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._step_id = 0
        self._last_idle_check = float("-inf")
        # Async steps not updated yet: step id -> the Request of each entry (an id may be reused
        # by a new request once the old one ended; its results must not reach the new one).
        self._in_flight: dict[int, tuple[Request, ...]] = {}
        self._finished_ids: list[str] = []  # finished since the last non-empty step (for the runner)
        # Structured outputs under async scheduling: a request with a grammar is scheduled like any
        # other while its token is in flight (the engine core fills its bitmask once that token is on
        # the host, while the step's forward pass runs). True only for an executor that cannot split
        # a step's forward pass and sampling: such a request then waits for its token.
        self.grammar_waits = grammar_waits
        # vLLM's partial prefill knobs. Off (max_num_partial_prefills 1, long_prefill_token_threshold 0):
        # the loops below take exactly today's decisions (a chunk is only ever cut by the budget, so at
        # most one request is mid-prefill anyway).
        cfg = scheduler_config
        self.prefills = PartialPrefillPolicy(cfg)
        self.kv_xfer = RemoteKVScheduling(kv_connector, self) if kv_connector is not None else None  # disagg

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_prompt_length(request.num_tokens, self.config.max_model_len)
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or (self.kv_xfer is not None and self.kv_xfer.has_pending())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------- schedule
    def schedule(self, async_scheduling: bool = False) -> SchedulerOutput:
        """The next step. With ``async_scheduling`` it may run before the previous step's results
        are in: each scheduled request is advanced at once (its KV counted as computed, and a
        placeholder appended for the token it samples), and a request whose in-flight token will
        end it by length is not scheduled again. ``update`` later fills the placeholder in.
        Stale state only ever makes this conservative: blocks of requests about to finish are
        still held, so nothing is admitted that the pool cannot hold. Not for drafts or forks.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return self._build_output(scheduled, preempted, async_scheduling)

    def _schedule_running(self, budget: int, scheduled: dict[str, int], preempted: list[Request]) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            if req.num_output_placeholders and (ends_by_length(req, req.num_tokens, self.config.max_model_len)
                                                or (self.grammar_waits and req.sampling_params.structured_outputs is not None)):
                idx += 1  # its in-flight token is its last one, or its grammar must see that token first
                continue
            needed = ledger.query_tokens(req.num_tokens, req.num_computed_tokens, len(req.spec_token_ids))
            # drafts are trimmed to fit, never overshoot; a long prefill's chunk is capped at the threshold
            n = ledger.charge(needed, self.prefills.chunk_budget(req, req.num_computed_tokens, budget), chunked=True)
            if n == 0:
                idx += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = max(self.running, key=lambda r: r.sort_key)
                if self.running.index(victim) < idx:
                    idx -= 1
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
                budget -= n
                idx += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
        """Admit waiting requests in order. When the next one's next prefix block is being computed
        right now (by a request scheduled in this step or in the step still in flight), admission
        stops for this step: that request then hits the block instead of computing the same KV again,
        and nothing behind it (lower priority or later) takes its seat or blocks meanwhile."""
        cfg = self.config
        pending = self._pending_block_hashes(scheduled)
        slots = self.prefills.slots(self.running, scheduled) if self.prefills.enabled else None
        idx = 0  # stays 0 unless a long prefill is skipped for lack of a long slot (vLLM's queue jumping)
        while idx < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[idx]
            taken = self.kv_xfer.admit_waiting(idx, budget, scheduled) if self.kv_xfer is not None else None
            if taken is not None:  # a remote prefix hit: loading (0 tokens), loaded (charged) or must wait (-1)
                if taken < 0:
                    break
                budget -= taken
                continue
            hit = self.kv.match_prefix(req)
            if pending and self._prefix_pending(req, hit, pending):
                self.stats.deferred_admissions += 1
                break
            n = self._admit(req, hit, budget, slots)
            if n == 0 and hit.partial_src is not None:
                # In a tight pool the partial source's pinned block can be the one we lack.
                hit = hit.without_partial()
                n = self._admit(req, hit, budget, slots)
            if n == SKIP_LONG:
                idx += 1
                continue
            if n <= 0:
                break
            self.waiting.pop(idx)
            req.num_computed_tokens = hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            host_tokens = len(hit.host_blocks) * self.kv.block_size
            self.stats.prefix_hit_tokens += hit.num_full_tokens - host_tokens  # device blocks only
            self.stats.partial_hit_tokens += hit.num_partial_tokens
            self.stats.host_hit_tokens += host_tokens
            scheduled[req.request_id] = n
            budget -= n
            if pending is not None:
                pending.update(self.kv.uncached_block_hashes(req, hit.num_tokens + n))

    def _pending_block_hashes(self, scheduled: dict[str, int]) -> Optional[set[int]]:
        """Hashes of full blocks whose KV is scheduled (this step or in flight) but not cached yet."""
        if not self.kv.enable_prefix_caching or not self.waiting:
            return None
        pending: set[int] = set()
        for req in self.running:
            pending.update(self.kv.uncached_block_hashes(req, req.num_computed_tokens + scheduled.get(req.request_id, 0)))
        return pending

    def _prefix_pending(self, req: Request, hit, pending: set[int]) -> bool:
        i = len(hit.blocks)  # the first block the cache could not serve
        return (i + 1) * self.kv.block_size < req.num_tokens and i < len(req.block_hashes) and req.block_hashes[i] in pending

    def _admit(self, req: Request, hit, budget: int, slots: Optional[PrefillSlots] = None) -> int:
        """Size the chunk on the exact hit, commit (pin + allocate) it, return the tokens to charge.
        With the partial prefill knobs (``slots``): SKIP_LONG or PARTIAL_FULL when it may not start
        now; nothing is committed then."""
        policy = self.prefills
        needed = ledger.query_tokens(req.num_tokens, hit.num_tokens, len(req.spec_token_ids))
        is_long = slots is not None and policy.is_long(req, hit.num_tokens)
        if is_long and slots.long >= policy.max_long:
            return SKIP_LONG
        n = ledger.charge(needed, policy.chunk_budget(req, hit.num_tokens, budget), self.config.enable_chunked_prefill)
        stays_partial = slots is not None and n > 0 and tokens_left(req, hit.num_tokens) - n > 1
        if stays_partial and slots.partial >= policy.max_partial:
            return PARTIAL_FULL
        if n == 0 or not self.kv.allocate_slots(req, n, hit):
            return 0
        if slots is not None:
            slots.partial += stays_partial
            slots.long += is_long
        return n

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: blocks go back to the pool (full ones stay cached)."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _build_output(self, scheduled: dict[str, int], preempted: list[Request],
                      async_scheduling: bool = False) -> SchedulerOutput:
        entries, reqs = [], []
        for rid, n in scheduled.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            num_real = min(n, req.num_tokens - start)
            drafts = req.spec_token_ids[: n - num_real]
            entries.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=tuple(req.all_token_ids[start:start + num_real]) + tuple(drafts),
                    start_position=start,
                    block_ids=self.kv.block_ids(rid),
                    sample=start + num_real == req.num_tokens,
                    sampling_params=req.sampling_params,
                    num_output_tokens=req.num_output_tokens,
                    num_draft_tokens=len(drafts),
                    beam_search=req.beam_search,
                    prompt_logprob_targets=prompt_logprob_targets(req, start, num_real),
                )
            )
            req.spec_token_ids = []
            reqs.append(req)
            if async_scheduling:
                if drafts:
                    raise ValueError("async scheduling does not verify draft tokens")
                req.num_computed_tokens = start + num_real
                if entries[-1].sample:
                    req.all_token_ids.append(PLACEHOLDER_TOKEN_ID)
                    req.num_output_placeholders += 1
        total = sum(scheduled.values())
        self._step_id += 1
        if entries:
            self.stats.steps += 1
            self.stats.scheduled_tokens += total
            self.stats.async_steps += async_scheduling
            if async_scheduling:
                self._in_flight[self._step_id] = tuple(reqs)
        so = SchedulerOutput(
            step_id=self._step_id,
            requests=tuple(entries),
            total_tokens=total,
            kv_transfers=self.kv.take_transfers(),
            preempted_request_ids=tuple(r.request_id for r in preempted),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            async_scheduled=async_scheduling,
            finished_request_ids=self._take_finished_ids() if entries else (),
        )
        return so if self.kv_xfer is None else self.kv_xfer.finish_output(so)  # + the step's remote loads

    # ----------------------------------------------------------------- results
    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish stopped requests.

        With drafts, `sampled[rid]` holds the accepted drafts plus one token; the KV of rejected
        drafts is not counted as computed (their slots are simply overwritten later).
        """
        if output.async_scheduled:
            return self._update_async(output, sampled)
        finished = []
        for entry in output.requests:
            req = self.requests.get(entry.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(entry.request_id, ()) if entry.sample else ()
            if entry.num_draft_tokens:
                self.stats.spec_proposed += entry.num_draft_tokens
                self.stats.spec_accepted += len(tokens) - 1
                self.stats.spec_verify_steps += 1
            rejected = entry.num_draft_tokens - max(len(tokens) - 1, 0)
            req.num_computed_tokens += entry.num_tokens - rejected
            status = None
            for token in tokens:
                req.all_token_ids.append(token)
                status = check_stop(req, req.num_tokens, self.config.max_model_len)
                if status is not None:
                    break
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1 if tokens else req.num_tokens)
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        self.kv.release_step()
        if not self.requests:
            self._check_when_idle()
        return finished

    def _update_async(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Results of an async-scheduled step: its requests were advanced when it was scheduled,
        so only the placeholder of each sampled token is filled in (also for a request preempted
        since, which will recompute) and the blocks it completed are cached. A request that stops
        here may already sit in the next in-flight step; that step's row for it is dropped."""
        finished = []
        for entry, scheduled_req in zip(output.requests, self._in_flight.pop(output.step_id)):
            req = self.requests.get(entry.request_id)
            if req is not scheduled_req:
                continue  # finished or aborted while the step ran (its id may be a new request's now)
            end = entry.start_position + entry.num_tokens  # KV this step computed; its token goes here
            if entry.sample:
                if req.all_token_ids[end] != PLACEHOLDER_TOKEN_ID:
                    raise AssertionError(f"{req.request_id}: no placeholder at position {end}")
                req.all_token_ids[end] = sampled[entry.request_id][0]
                req.num_output_placeholders -= 1
                status = check_stop(req, end + 1, self.config.max_model_len)
                if status is not None:
                    if req.status == RequestStatus.RUNNING:
                        self.kv.cache_blocks(req, end)
                    del req.all_token_ids[end + 1:]
                    req.num_output_placeholders = 0
                    self._finish(req, status)
                    finished.append(req)
                    continue
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_blocks(req, end)
        self.kv.release_step()
        if not self.requests:
            self._check_when_idle()
        return finished

    def _check_when_idle(self) -> None:
        """free + cached + in use == total, walked while idle; at most every few seconds, since on
        a GPU-sized pool one walk costs ~0.1 s and the next request should not wait for it."""
        now = time.monotonic()
        if now - self._last_idle_check >= IDLE_CHECK_INTERVAL_S:
            self._last_idle_check = now
            self.kv.check_integrity()

    def fail_step(self, output: SchedulerOutput, error: str, transfers_ran: bool = True) -> list[Request]:
        """A step that could not run fails only its own requests; the loop goes on."""
        if not transfers_ran:
            self.kv.discard_offloads(output.kv_transfers.offloads)
        scheduled_reqs = self._in_flight.pop(output.step_id, None)
        failed = []
        for i, entry in enumerate(output.requests):
            req = self.requests.get(entry.request_id)
            if req is None or req.is_finished() or (scheduled_reqs is not None and req is not scheduled_reqs[i]):
                continue
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            failed.append(req)
        self.kv.release_step()
        return failed

    def fork_request(self, parent_id: str, child_id: str) -> Request:
        """A copy of a request sharing its computed KV (beam search). Raises ValueError if the
        pool has no block for the copy-on-write of the parent's partial last block."""
        parent = self.requests[parent_id]
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params, max_tokens=parent.max_tokens,
                        eos_token_ids=parent.eos_token_ids, priority=parent.priority, arrival_time=parent.arrival_time)
        child.arrival_seq = parent.arrival_seq
        child.beam_search = parent.beam_search
        child.all_token_ids = list(parent.all_token_ids)
        child.block_hashes = list(parent.block_hashes)
        if parent.status == RequestStatus.RUNNING:
            if not self.kv.fork(parent, child):
                raise ValueError("the KV cache has no free block for a beam; lower beam_width or add memory")
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:  # the parent was preempted: the copy recomputes its context too
            bisect.insort(self.waiting, child, key=lambda r: r.sort_key)
        self.requests[child_id] = child
        return child

    def append_token(self, request_id: str, token_id: int) -> None:
        """Extend a request whose next token was chosen outside the sampler (beam search)."""
        self.requests[request_id].all_token_ids.append(token_id)

    def set_draft_tokens(self, request_id: str, draft_token_ids: list[int]) -> None:
        """Drafts for the next step, trimmed so verification never runs past max_tokens or max_model_len."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return
        room = min(req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens) - 1
        req.spec_token_ids = list(draft_token_ids[: max(room, 0)])

    def reserve_lookahead(self, request_id: str, num_tokens: int) -> bool:
        """Blocks for `num_tokens` slots past the computed ones (a draft model writes its KV there)."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return False
        num_tokens = min(num_tokens, self.config.max_model_len - req.num_computed_tokens)
        return self.kv.allocate_slots(req, num_tokens)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside (client abort, stop string, error)."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, status)
            done.append(req)
        return done

    def _take_finished_ids(self) -> tuple[str, ...]:
        ids, self._finished_ids = tuple(self._finished_ids), []
        return ids

    def stop_request(self, req: Request, num_output_tokens: int, stop_reason: int | str | None) -> None:
        """End a request the engine found stopped (a stop string) after ``num_output_tokens`` output
        tokens: later tokens and placeholders are dropped; if it still runs, its blocks are freed."""
        del req.all_token_ids[req.num_prompt_tokens + num_output_tokens:]
        req.num_output_placeholders = 0
        if not req.is_finished() and self.requests.get(req.request_id) is req:
            req.stop_reason = stop_reason
            self._finish(req, RequestStatus.FINISHED_STOPPED)

    def check_integrity(self) -> None:
        """After a failed step: release the step's pins, then walk the KV cache's invariants
        (raises AssertionError if they are broken)."""
        self.kv.release_step()
        self.kv.check_integrity()

    def snapshot(self) -> dict[str, int]:  # read-only counters and gauges for stats() (core/stats.py)
        return scheduler_snapshot(self)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self._finished_ids.append(req.request_id)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if self.kv_xfer is None or not self.kv_xfer.on_finish(req):  # a running load / a producer hold keeps them
            self.kv.free(req)
        del self.requests[req.request_id]
