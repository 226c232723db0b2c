"""The simulator: the REAL Scheduler and KV cache manager on a virtual clock.

Each step: schedule -> check the ledger (forward tokens == scheduled <= budget) -> price the
step with the cost model -> advance the clock -> synthetic sampled tokens -> Scheduler.update.
Sampled tokens ignore EOS, so every request runs to max_tokens; a conversation's next turn
carries the synthetic reply in its history. `kv.check_integrity()` runs every
`integrity_every` steps, whenever the scheduler goes idle, and at the end.
"""

from __future__ import annotations

import heapq
from collections import deque
import time
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from tallyserve.bench.metrics import RequestRecord
from tallyserve.bench.workloads import RequestSpec, Workload
from tallyserve.config import EngineConfig
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.engine.core import EngineCore, StepResult
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.request import Request, RequestStatus
from tallyserve.runner.rejection_sampler import TokenSample
from tallyserve.sampling_params import SamplingParams
from tallyserve.sim.cost_model import StepShape
from tallyserve.sim.executor import CostModelExecutor
from tallyserve.sim.tokens import ConversationTokens, SimTokenizer


INTEGRITY_SHARE = 0.1


class SimulationError(RuntimeError):
    """The simulated engine could make no progress (a request that can never be scheduled)."""


@dataclass
class SimOptions:
    max_concurrency: Optional[int] = None  # client side: most requests in flight
    # Steps between kv.check_integrity() calls (1: every step). None: adaptive, so that the
    # checks (O(pool size) each) take about INTEGRITY_SHARE of the wall time.
    integrity_every: Optional[int] = None
    build_batches: bool = False  # build the real ForwardBatch every step (slow; for tests)
    token_fn: Optional[Callable[[str, int], int]] = None  # (request id, output index) -> token
    record_steps: bool = False  # keep each step's ((request id, tokens, start position)..., kv_transfers)
    max_steps: Optional[int] = None
    progress: bool = False
    # Schedule step N+1 before step N's tokens are in, as the engine does on a GPU (None: the
    # engine arguments' async_scheduling, which defaults to on, as on CUDA).
    async_scheduling: Optional[bool] = None


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # virtual
    stats: dict[str, Any]
    steps: list[tuple] = field(default_factory=list)
    wall_s: float = 0.0


class _Live:
    __slots__ = ("spec", "conv", "prompt", "record", "seed", "request")

    def __init__(self, spec: RequestSpec, conv: int, prompt: list[int], record: RequestRecord, seed: int) -> None:
        self.spec, self.conv, self.prompt, self.record, self.seed = spec, conv, prompt, record, seed
        self.request: Optional[Request] = None


class Simulator:
    def __init__(self, config: EngineConfig, cost_model, options: Optional[SimOptions] = None) -> None:
        self.config = config
        self.cost = cost_model
        self.opts = options or SimOptions()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)
        self.tok = SimTokenizer(config.model_config.vocab_size)
        self.eos = tuple(config.model_config.eos_token_ids)
        self.now = 0.0
        self.busy_s = 0.0
        self.peak_blocks = 0
        self.integrity_checks = 0
        self.violations: list[str] = []
        self.steps: list[tuple] = []
        self._step_end: dict[int, float] = {}  # step id -> virtual time its forward pass ended
        mode = self.opts.async_scheduling
        self.async_scheduling = mode if mode is not None else config.args.async_scheduling is not False
        if hasattr(cost_model, "async_scheduling"):  # a measured profile overlaps host and device work
            cost_model.async_scheduling = self.async_scheduling
        # cascade attention, as the GPU engine runs it: decode rows sharing a prefix read it once
        self.cascade = not config.args.disable_cascade_attn and getattr(cost_model, "cascade", True)

    # ----------------------------------------------------------------- requests
    def _submit(self, conv_idx: int) -> None:
        turns, pos = self._convs[conv_idx], self._turn[conv_idx]
        spec = turns[pos]
        record = RequestRecord(spec.request_id, spec.conversation_id, spec.turn, start_s=self.now,
                               chunk_times_s=array("d"))
        self._records[spec.request_id] = record
        if self._failed[conv_idx]:
            record.error_kind, record.error = "skipped_after_error", "an earlier turn failed"
            self._advance(conv_idx)
            return
        prompt = self._conv_tokens[conv_idx].prompt_for(spec)
        record.prompt_tokens = len(prompt)
        live = _Live(spec, conv_idx, prompt, record, zlib.crc32(spec.request_id.encode()))
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(spec.request_id, prompt, params, max_tokens=spec.max_tokens, eos_token_ids=self.eos,
                      arrival_time=self.now)
        try:
            self.scheduler.add_request(req)
        except ValueError as exc:
            record.error_kind, record.error = "invalid_request", str(exc)
            self._failed[conv_idx] = True
            self._advance(conv_idx)
            return
        live.request = req
        self._live[spec.request_id] = live

    def _advance(self, conv_idx: int, now: Optional[float] = None) -> None:
        """Queue the conversation's next turn (if any) after its think time."""
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
        self._turn[conv_idx] += 1
        turns, pos = self._convs[conv_idx], self._turn[conv_idx]
        if pos < len(turns):
            spec = turns[pos]
            at = max((self.now if now is None else now) + spec.think_time_s, spec.arrival_s or 0.0)
            heapq.heappush(self._arrivals, (at, self._seq, conv_idx))
            self._seq += 1

    def _release_arrivals(self) -> None:
        cap = self.opts.max_concurrency
        while self._arrivals and self._arrivals[0][0] <= self.now:
            _, _, conv_idx = heapq.heappop(self._arrivals)
            self._client_queue.append(conv_idx)
        while self._client_queue and (cap is None or len(self._live) < cap):
            self._submit(self._client_queue.popleft())

    def _complete(self, req: Request, now: Optional[float] = None) -> None:
        """``now``: when its last step ended (async scheduling learns of it one step later)."""
        now = self.now if now is None else now
        live = self._live.pop(req.request_id)
        rec = live.record
        rec.latency_s = now - rec.start_s
        rec.completion_tokens = len(req.output_token_ids)  # placeholders of a failed in-flight step excluded
        rec.cached_tokens = max(req.num_cached_tokens, 0)
        rec.finish_reason = req.status.finish_reason
        if req.status == RequestStatus.FINISHED_ERROR:
            rec.error_kind, rec.error = "ledger_violation", req.error
            self._failed[live.conv] = True
        else:
            self._conv_tokens[live.conv].add_reply(live.prompt, req.output_token_ids)
        self._advance(live.conv, now)

    # ----------------------------------------------------------------- one step
    def record_step(self, so: SchedulerOutput, overlapped: bool = False) -> float:
        """Price a launched step on the virtual clock; returns when it ends. ``overlapped``: it was
        launched while the step before was still in flight (async scheduling), so its host part ran
        during that step's device part; a step launched with nothing in flight pays both in turn."""
        shape = StepShape.of(so, self.config.cache_config.block_size, self.cascade)
        dt = self.cost.step_time(shape, overlapped=self.async_scheduling and overlapped)
        self.now += dt
        self.busy_s += dt
        self._step_end[so.step_id] = self.now
        if self.opts.record_steps:
            self.steps.append((tuple((e.request_id, len(e.token_ids), e.start_position) for e in so.requests),
                               so.kv_transfers))
        kv = self.scheduler.kv
        self.peak_blocks = max(self.peak_blocks, kv.num_total_blocks - kv.num_free_blocks)
        return self.now

    def sample(self, so: SchedulerOutput, now: float) -> dict[str, list[TokenSample]]:
        """Synthetic tokens for the rows that sample (first-token and chunk times recorded)."""
        sampled: dict[str, list[TokenSample]] = {}
        token_fn, live = self.opts.token_fn, self._live
        for e in so.requests:
            if e.sample:
                lv = live[e.request_id]
                idx = e.num_output_tokens
                tok = token_fn(e.request_id, idx) if token_fn else self.tok.synthetic_token(lv.seed, idx)
                sampled[e.request_id] = [TokenSample(tok, 0.0, None)]
                times = lv.record.chunk_times_s
                if not times:
                    lv.record.ttft_s = now - lv.record.start_s
                times.append(now)
        return sampled

    def _on_result(self, result: StepResult) -> None:
        ended = self._step_end.pop(result.so.step_id, self.now)
        if result.output is None:
            if isinstance(result.error, ledger.LedgerError):
                self.violations.append(f"step {result.so.step_id}: {result.error}")
            for req in result.failed:
                self._complete(req)
            return
        for req in result.finished:
            self._complete(req, ended)

    # ----------------------------------------------------------------- the loop
    def _setup(self, workload: Workload) -> None:
        self._convs = workload.conversations()
        self._turn = [0] * len(self._convs)
        self._failed = [False] * len(self._convs)
        self._conv_tokens = [ConversationTokens(self.tok) for _ in self._convs]
        self._records: dict[str, RequestRecord] = {}
        self._live: dict[str, _Live] = {}
        self._client_queue: deque[int] = deque()
        self._arrivals = [(c[0].arrival_s or 0.0, i, i) for i, c in enumerate(self._convs)]
        heapq.heapify(self._arrivals)
        self._seq = len(self._convs)
        self._done = 0
        self._bar = None

    def _check_integrity(self) -> None:
        t0 = time.perf_counter()
        self.scheduler.kv.check_integrity()
        t1 = time.perf_counter()
        self.integrity_checks += 1
        self._next_check_wall = t1 + (t1 - t0) / INTEGRITY_SHARE

    def _integrity_due(self, n_steps: int) -> bool:
        every = self.opts.integrity_every
        if every is not None:
            return n_steps % max(1, every) == 0
        return (n_steps & 63) == 0 and time.perf_counter() >= self._next_check_wall

    def run(self, workload: Workload) -> SimResult:
        wall0 = time.perf_counter()
        self._setup(workload)
        sched = self.scheduler
        self._next_check_wall = 0.0
        self._bar = tqdm(total=len(workload), desc="simulate", unit="req", disable=not self.opts.progress)
        n_steps = 0
        core = EngineCore(sched, CostModelExecutor(self))
        try:
            while True:
                self._release_arrivals()
                if not sched.has_unfinished_requests() and not core.has_inflight():
                    if not self._arrivals:
                        break
                    self.now = max(self.now, self._arrivals[0][0])
                    continue
                results = core.step(async_scheduling=self.async_scheduling)
                if core.last_so.is_empty and not core.has_inflight() and not results:
                    raise SimulationError(
                        f"nothing schedulable at t={self.now:.3f}s with {sched.num_waiting} waiting and "
                        f"{sched.num_running} running requests: a prompt needs more KV blocks than the pool has")
                for result in results:
                    self._on_result(result)
                n_steps += 1
                if self._integrity_due(n_steps):
                    self._check_integrity()
                if self.opts.max_steps is not None and n_steps >= self.opts.max_steps:
                    raise SimulationError(f"stopped after max_steps={n_steps} with requests unfinished")
        finally:
            self._bar.close()
        self._check_integrity()
        if sched.kv.num_free_blocks != sched.kv.num_total_blocks:
            raise SimulationError("KV blocks leaked: the pool is not free once every request finished")
        records = [self._records[s.request_id] for s in workload.requests]
        return SimResult(records, self.now, self._stats(records), self.steps, time.perf_counter() - wall0)

    def _stats(self, records: list[RequestRecord]) -> dict[str, Any]:
        st = self.scheduler.stats
        kv = self.scheduler.kv
        prompt = sum(r.prompt_tokens or 0 for r in records if r.ok)
        cached = sum(r.cached_tokens or 0 for r in records if r.ok)
        return {
            "cost_model": self.cost.name,
            "steps": st.steps,
            "busy_s": round(self.busy_s, 6),
            "ledger": {
                "scheduled_tokens": st.scheduled_tokens,
                "forward_tokens": st.forward_tokens,
                "violations": st.ledger_violations,
                "exact": st.scheduled_tokens == st.forward_tokens and st.ledger_violations == 0,
                "max_num_batched_tokens": self.config.scheduler_config.max_num_batched_tokens,
            },
            "prefix_hit_rate": round(cached / prompt, 6) if prompt else 0.0,
            "prefix_hit_tokens": st.prefix_hit_tokens,
            "partial_hit_tokens": st.partial_hit_tokens,
            "host_hit_tokens": st.host_hit_tokens,
            "preemptions": st.preemptions,
            "kv": {
                "num_blocks": kv.num_total_blocks,
                "block_size": self.config.cache_config.block_size,
                "peak_blocks_used": self.peak_blocks,
                "peak_use": round(self.peak_blocks / kv.num_total_blocks, 6),
                "evictions": kv.pool.num_evictions,
                "num_host_blocks": kv.host.num_blocks if kv.host is not None else 0,
                "host_blocks_offloaded": kv.host.num_offloaded if kv.host is not None else 0,
                "integrity_checks": self.integrity_checks,
            },
            "violation_messages": self.violations[:20],
        }
