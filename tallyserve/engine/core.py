"""EngineCore: the only step loop. schedule -> ledger check -> executor launch -> complete ->
Scheduler.update, with step-failure accounting in one place. Structured outputs split the launch:
forward pass, then (after the previous step completed) the grammar bitmask and the sampling.

Synchronous scheduling is async scheduling whose step completes at once: the same launch and
the same completion, only the in-flight slot is skipped. The server's engine, the offline LLM,
`tallyserve simulate` (a cost-model executor) and `tallyserve profile` all step through here, so
what the simulator admits is what the server admits by construction.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from tallyserve.core import ledger
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.core.scheduler import Scheduler
from tallyserve.executor.abstract import DeferredSample, Executor, ExecutorDeadError, StepHandle
from tallyserve.request import Request
from tallyserve.runner.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from tallyserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

TIMING_KEYS = ("schedule", "launch", "wait", "update", "grammar")
KV_IDLE_WAIT_S = 0.002  # an empty step while only KV transfers are pending: do not spin


class KVTransferError(RuntimeError):
    """A request's remote KV could not be loaded and its policy is to fail."""


class DraftSource:
    """Where the core gets the proposal distributions of a step's drafts (draft-model speculation)."""

    def draft_probs_for(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        return {}


@dataclass
class StepResult:
    """One finished (or failed) step: what the engine needs to emit outputs."""

    so: SchedulerOutput
    scheduled: dict[str, Request]  # each entry's Request as scheduled (an id may be reused later)
    output: Optional[ModelRunnerOutput] = None  # None: the step failed
    finished: list[Request] = field(default_factory=list)  # stopped by the scheduler (EOS, length, ...)
    failed: list[Request] = field(default_factory=list)  # ended by this step's failure
    error: Optional[Exception] = None


@dataclass
class _Launched:
    so: SchedulerOutput
    scheduled: dict[str, Request]
    handle: Optional[StepHandle]  # None until a deferred step is sampled
    deferred: Optional[DeferredSample] = None  # forward queued; grammar rows wait for their bitmask


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, drafts: Optional[DraftSource] = None,
                 grammar: Optional["StructuredOutputManager"] = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.drafts = drafts or DraftSource()
        self.timings = {k: 0.0 for k in TIMING_KEYS}
        # Test hook: called with each SchedulerOutput before the forward pass (may raise).
        self.fault_injector: Optional[Callable[[SchedulerOutput], None]] = None
        self.inflight: Optional[_Launched] = None
        self.active: list[SchedulerOutput] = []  # steps the current step() call scheduled or completes
        self.last_so: Optional[SchedulerOutput] = None
        # Structured outputs: fills each step's grammar bitmask, if given.
        self.grammar = grammar

    def has_inflight(self) -> bool:
        return self.inflight is not None

    # ----------------------------------------------------------------- the loop
    def step(self, async_scheduling: bool = False) -> list[StepResult]:
        """One iteration. Async: schedule and launch step N+1, then complete step N (its tokens
        were on the device meanwhile). Sync: a step in flight is completed first (and alone).
        A step with grammar rows launches its forward pass only; once step N's results are applied
        (its tokens accepted by the matchers), the bitmask is filled and the sampling queued."""
        self.active = []
        if not async_scheduling and self.inflight is not None:
            prev, self.inflight = self.inflight, None
            return [self._complete(prev)]
        t0 = time.perf_counter()
        so = self.scheduler.schedule(async_scheduling=async_scheduling)
        self.last_so = so
        self.active.append(so)
        scheduled = {e.request_id: self.scheduler.requests[e.request_id] for e in so.requests}
        t1 = time.perf_counter()
        self.timings["schedule"] += t1 - t0
        launched, failure = None, None
        if not so.is_empty:
            launched, failure = self._launch(so, scheduled)
        elif so.kv_transfers:  # e.g. copy-on-write of forked beams queued since the last step
            self.executor.apply_transfers(so.kv_transfers)
            self.executor.flush_transfers()
        self.timings["launch"] += time.perf_counter() - t1
        kv_failed = self._kv_connector_step(so)  # after the step's block moves: an evicted block is offloaded first
        results = []
        if async_scheduling:
            prev, self.inflight = self.inflight, launched
            if prev is not None:  # its tokens reach the host while this step's forward runs
                results.append(self._complete(prev))
            elif so.is_empty and so.kv_transfers:
                self.scheduler.update(so, {})
        if launched is not None and launched.deferred is not None:
            failure = self._sample_deferred(launched)  # grammar bitmask now: the matchers saw prev's tokens
            if failure is not None:
                launched = None
                if async_scheduling:
                    self.inflight = None
        if not async_scheduling:
            if launched is not None:
                results.append(self._complete(launched))
            elif so.is_empty and so.kv_transfers:
                self.scheduler.update(so, {})
        if failure is not None:  # after the previous step's results: what stopped there stays stopped
            results.append(self._fail(so, scheduled, failure[0], transfers_ran=failure[1]))
        if kv_failed is not None:
            results.append(kv_failed)
        return results

    def _kv_connector_step(self, so: SchedulerOutput) -> Optional[StepResult]:
        """Disaggregated serving: the workers start the loads this step committed (its connector
        metadata, built from ``so``) and report what finished; the scheduler applies the report. A
        step with nothing to compute while transfers are pending yields the CPU briefly."""
        xfer = self.scheduler.kv_xfer
        if xfer is None:
            return None
        out = self.executor.kv_connector_step(so.kv_connector_metadata)
        failed = xfer.process(out)
        if so.is_empty and not so.kv_loads and not (out.finished_recving or out.failed_recving):
            time.sleep(KV_IDLE_WAIT_S)
        if not failed:
            return None
        return StepResult(so, {}, None, failed=failed, error=KVTransferError((failed[0].error or "").removeprefix("KVTransferError: ")))

    def _launch(self, so: SchedulerOutput, scheduled: dict[str, Request]
                ) -> tuple[Optional[_Launched], Optional[tuple[Exception, bool]]]:
        """Transfers, batch, ledger check, forward and sampling of one step, queued. On failure:
        (None, (exception, whether the transfers ran)); only this step's requests fail."""
        try:
            self.executor.apply_transfers(so.kv_transfers)
        except ExecutorDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - the promised host copies never happened
            return None, (exc, False)
        prev = self.inflight.handle if self.inflight is not None else None
        try:
            prepared = self.executor.prepare(so, prev)
            self.scheduler.stats.forward_tokens += prepared.num_tokens
            ledger.check_step(so.total_tokens, prepared.num_tokens, so.max_num_batched_tokens)
            if self.fault_injector is not None:
                self.fault_injector(so)
            drafts = self.drafts.draft_probs_for(so)
            if self.grammar is not None and self.grammar.needs_bitmask(so):
                if self.executor.defers_sampling:  # the bitmask is filled after the step in flight completes
                    return _Launched(so, scheduled, None, self.executor.launch_forward(so, prepared, prev, drafts)), None
                # the scheduler holds grammar rows back while their token is in flight (Scheduler.grammar_waits)
                run_so = self._with_bitmask(so, scheduled)
                handle = self.executor.launch(run_so, prepared, prev, drafts)
                self.grammar.uploaded()
                return _Launched(so, scheduled, handle), None
            handle = self.executor.launch(so, prepared, prev, drafts)
            return _Launched(so, scheduled, handle), None
        except ExecutorDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed step fails only its own requests
            return None, (exc, True)

    def _with_bitmask(self, so: SchedulerOutput, scheduled: dict[str, Request]) -> SchedulerOutput:
        """``so`` with the grammar bitmask of its rows attached (the matchers accept the tokens
        their requests have on the host first)."""
        t0 = time.perf_counter()
        bitmask = self.grammar.bitmask_for(so, scheduled)
        self.timings["grammar"] += time.perf_counter() - t0
        return so if bitmask is None else dataclasses.replace(so, grammar_bitmask=bitmask)

    def _sample_deferred(self, launched: _Launched) -> Optional[tuple[Exception, bool]]:
        """Fill the bitmask of a step whose forward pass is queued and queue its sampling. Runs
        after the previous step's results were applied, so every grammar row's matcher has
        accepted its request's newest token; the host work overlaps this step's forward pass."""
        deferred, launched.deferred = launched.deferred, None
        try:
            run_so = self._with_bitmask(launched.so, launched.scheduled)
            t0 = time.perf_counter()
            launched.handle = deferred.sample(run_so)
            self.grammar.uploaded()
            self.timings["launch"] += time.perf_counter() - t0
            return None
        except ExecutorDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - fails only this step's requests
            return exc, True

    def _complete(self, launched: _Launched) -> StepResult:
        """Wait for a launched step's results, then update the scheduler."""
        self.active.append(launched.so)
        t0 = time.perf_counter()
        try:
            output = launched.handle.result()
        except ExecutorDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a device error surfacing at the copy
            return self._fail(launched.so, launched.scheduled, exc)
        t1 = time.perf_counter()
        self.timings["wait"] += t1 - t0
        finished = self.scheduler.update(launched.so, output.token_ids())
        self.timings["update"] += time.perf_counter() - t1
        return StepResult(launched.so, launched.scheduled, output, finished)

    def _fail(self, so: SchedulerOutput, scheduled: dict[str, Request], exc: Exception,
              transfers_ran: bool = True, count: bool = True) -> StepResult:
        """The one place a step's failure is counted and its requests are ended."""
        if not count:
            pass
        elif isinstance(exc, ledger.LedgerError):
            self.scheduler.stats.ledger_violations += 1
            logger.error("ledger violation, failing step %d: %s", so.step_id, exc)
        else:
            self.scheduler.stats.step_errors += 1
            logger.error("engine step %d failed", so.step_id, exc_info=exc)
        failed = self.scheduler.fail_step(so, f"{type(exc).__name__}: {exc}", transfers_ran)
        return StepResult(so, scheduled, None, failed=failed, error=exc)

    def fail_active(self, exc: Exception) -> list[StepResult]:
        """Last resort (an exception escaped the step): fail the steps this call was handling and
        drop the one in flight. Not counted here: the caller counts the escape once."""
        inflight, self.inflight = self.inflight, None
        steps = {id(s): s for s in self.active}
        if inflight is not None:
            steps.setdefault(id(inflight.so), inflight.so)
        return [self._fail(so, {}, exc, count=False) for so in steps.values()]
