"""LLMEngine: requests in, RequestOutputs out. The step loop itself is EngineCore's
(schedule -> ledger check -> executor -> update); this class adds what users see on top of it:
prompts and tokenization, n > 1, detokenization and stop strings, logprobs, beam search groups,
speculative drafts, and the last-resort guard that keeps the loop alive."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Union

import torch

from tallyserve.config import EngineArgs
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.core.scheduler import Scheduler
from tallyserve.engine.beam_search import BeamSearchDriver, BeamSearchParams
from tallyserve.engine.core import EngineCore, StepResult
from tallyserve.engine.input_processor import EngineCoreRequest, InputProcessor, PromptType
from tallyserve.engine.output_processor import OutputProcessor, ParentState, SequenceState, make_detokenizer
from tallyserve.engine.spec_runner import SpecDecodeRunner
from tallyserve.executor import create_executor
from tallyserve.executor.abstract import ExecutorDeadError
from tallyserve.executor.resolve import resolve_engine
from tallyserve.outputs import RequestOutput
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tallyserve.structured_output.compiler import CompileTicket
from tallyserve.structured_output.limits import StructuredOutputsLimits
from tallyserve.structured_output.manager import STRUCTURED_STATS_KEY, StructuredOutputManager
from tallyserve.distributed.kv_transfer.factory import make_connector

logger = logging.getLogger(__name__)

# How long an otherwise idle step waits for a grammar to finish compiling.
IDLE_COMPILE_WAIT_S = 0.05


class EngineFatalError(RuntimeError):
    """The device or the engine's own invariants are broken: the loop must stop (and say why).
    Nothing a request carries raises this; a request's failure ends only that request."""


def _device_broken(exc: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "device-side assert" in str(exc))


class LLMEngine:
    """The engine core with its request front: `add_request` (an InputProcessor validates and
    tokenizes), `step` (EngineCore runs the step; this class turns its results into RequestOutputs
    through the OutputProcessor, advances beam groups and drafts, and admits requests whose grammar
    compiled), `abort_request`. ``wait_for_grammars``: compile a request's grammar in `add_request`
    (the offline LLM: a constraint that does not compile is a ValueError there); otherwise a request
    waits for its compile outside the scheduler. ``final_outputs_only``: `step` returns the outputs of finished
    requests only (callers that do not stream skip building the others every step)."""

    def __init__(self, args: EngineArgs, wait_for_grammars: bool = False, final_outputs_only: bool = False) -> None:
        resolved, self.tokenizer = resolve_engine(args)  # every argument checked before anything loads
        self.resolved = resolved
        mc = self.model_config = resolved.model_config
        self.device, self.dtype, self.eos_token_ids = resolved.device, resolved.dtype, resolved.eos_token_ids
        self.served_model_name = resolved.served_model_name
        torch.manual_seed(args.seed)
        self.executor, self.config = create_executor(resolved)
        self.runner = getattr(self.executor, "runner", None)  # the in-process ModelRunner, if any (diagnostics)
        self.kv_connector = None  # the scheduler half of disaggregated serving
        if args.kv_transfer_config is not None:
            self.kv_connector = make_connector(args.kv_transfer_config, args.block_size, role="scheduler")
        sc = self.config.scheduler_config
        self.input_processor = InputProcessor(self.tokenizer, mc.vocab_size, sc.max_model_len, args.max_logprobs,
                                              sc.max_num_seqs, self.kv_connector)
        self.scheduler = Scheduler(sc, self.config.cache_config, self.kv_connector,
                                   grammar_waits=not self.executor.defers_sampling)
        pin = self.device.type == "cuda" and self.executor.defers_sampling  # the runner shares this process
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, self.eos_token_ids, pin_memory=pin,
                                                  limits=StructuredOutputsLimits.from_args(args))
        self.wait_for_grammars = wait_for_grammars
        self.spec = None
        if args.speculative_config:
            self.spec = SpecDecodeRunner.create(resolved, self.scheduler, self.config.cache_config.num_blocks,
                                                self.structured)
        self.core = EngineCore(self.scheduler, self.executor, drafts=self.spec, grammar=self.structured)
        self.beams = BeamSearchDriver(self.scheduler, self.tokenizer, self.eos_token_ids)
        self.output = OutputProcessor(self.tokenizer, self.scheduler, on_end=self._forget,
                                      final_outputs_only=final_outputs_only)
        # Async scheduling: the next step is scheduled and launched before this one's tokens are
        # read back (not with speculative decoding; beam groups run synchronously).
        self.async_scheduling = args.async_scheduling
        if self.async_scheduling is None:  # default: on where it overlaps something (CUDA)
            self.async_scheduling = self.executor.overlaps_host and self.spec is None

    @property
    def fault_injector(self) -> Optional[Callable[[SchedulerOutput], None]]:
        """Test hook: called with each SchedulerOutput before the forward pass (may raise)."""
        return self.core.fault_injector

    @fault_injector.setter
    def fault_injector(self, fn: Optional[Callable[[SchedulerOutput], None]]) -> None:
        self.core.fault_injector = fn

    @property
    def current_step_tokens(self) -> int:
        """Tokens of the step being run now (0 between steps): what health predicts its time from."""
        so = self.core.last_so
        return so.total_tokens if so is not None and self.core.active else 0

    @property
    def timings(self) -> dict[str, float]:
        return self.core.timings

    # ----------------------------------------------------------------- requests
    def process_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A prompt string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids."""
        return self.input_processor.process_prompt(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    kv_transfer_params: Optional[dict] = None) -> None:
        self.add_core_request(self.input_processor.process(request_id, prompt, params, priority, arrival_time,
                                                           kv_transfer_params))

    def add_core_request(self, request: EngineCoreRequest) -> None:
        """Admit a request the InputProcessor made (validated and tokenized; nothing is checked again)."""
        request_id, params, ids = request.request_id, request.params, request.prompt_token_ids
        if request_id in self.output.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        ticket = self._submit_grammar(params)
        parent = ParentState(request_id, request.prompt, ids, params,
                             metrics={"arrival_time": request.arrival_time or time.time()},
                             prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None)
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child_params = params if (i == 0 or params.seed is None) else params.clone(seed=params.seed + i)
            if i and child_params.prompt_logprobs is not None:  # the children share one prompt: the first scores it
                child_params = child_params.clone(prompt_logprobs=None)
            req = Request(child_id, ids, child_params, max_tokens=request.max_tokens,
                          eos_token_ids=self.eos_token_ids, priority=request.priority,
                          arrival_time=request.arrival_time)
            req.kv_transfer_params = request.kv_transfer_params
            parent.children.append(SequenceState(req, i, request_id, make_detokenizer(self.tokenizer, req)))
        self.output.add(parent)
        if ticket is not None and not ticket.future.done():
            self.structured.park(request_id, ticket)  # scheduled once its grammar is compiled
        else:
            self._schedule(parent, ticket)

    def _submit_grammar(self, params: SamplingParams) -> Optional[CompileTicket]:
        """Start compiling the request's grammar; ValueError now if it is already known bad (or, with
        wait_for_grammars, once it failed to compile)."""
        if params.structured_outputs is None:
            return None
        ticket = self.structured.submit(params.structured_outputs)
        fut = ticket.future
        if self.wait_for_grammars or (fut.done() and fut.exception() is not None):
            try:
                self.structured.result(ticket)  # raises the ValueError of a constraint that does not compile
            except BaseException:
                self.structured.release(ticket)
                raise
        return ticket

    def _schedule(self, parent: ParentState, ticket: Optional[CompileTicket]) -> None:
        """Hand the parent's sequences to the scheduler, each with a matcher of its compiled grammar."""
        if ticket is not None:
            compiled = self.structured.take(ticket)
            for seq in parent.children:
                kind = seq.request.sampling_params.structured_outputs.kind
                self.structured.register(seq.request.request_id, compiled, kind)
        for seq in parent.children:
            self.scheduler.add_request(seq.request)

    def _admit_compiled(self) -> None:
        """Before a step: schedule the parked requests whose grammar compiled, fail those whose grammar
        did not. When nothing else can run, wait a moment for a compile instead of spinning."""
        idle = not self.scheduler.requests and not self.core.has_inflight()
        for rid, ticket in self.structured.ready(IDLE_COMPILE_WAIT_S if idle else 0.0):
            parent = self.output.parents.get(rid)
            if parent is None:
                self.structured.release(ticket)
                continue
            try:
                self._schedule(parent, ticket)
            except Exception as exc:  # noqa: BLE001 - the constraint did not compile (or was cancelled)
                self.output.end_unscheduled(parent, RequestStatus.FINISHED_ERROR, str(exc))

    def _forget(self, request_id: str) -> None:
        """A sequence ended: its matcher and its drafts go."""
        self.structured.forget(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.output.parents.get(rid)
            if parent is None:
                continue
            if self.structured.unpark(rid):
                self.output.end_unscheduled(parent, RequestStatus.FINISHED_ABORTED, None)
                continue
            ids = [c.request.request_id for c in parent.children if c.finish_reason is None]
            for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
                self.output.finish(self.output.seqs[req.request_id], req)
            self.output.pending.append(self.output.pop_if_finished(parent))

    def abort_all(self) -> None:
        """Abort every request and beam search group (the loop stops)."""
        for gid in list(self.beams.groups):
            self.beams.abort(gid)
        self.abort_request(list(self.output.parents))

    def has_unfinished_requests(self) -> bool:
        xfer = self.scheduler.kv_xfer  # disaggregated serving: loads running, blocks held for a consumer
        return bool(self.output.parents) or bool(self.output.pending) or bool(self.beams.groups) \
            or self.core.has_inflight() or (xfer is not None and xfer.has_pending())

    def add_beam_search_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams) -> None:
        _, ids = self.process_prompt(prompt)
        self.beams.add(request_id, ids, params)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of requests that progressed. With async
        scheduling the step returned is the previous one: this call schedules and launches the
        next step first, so the host's work overlaps the device's.

        Nothing a request carries ends the loop: a failure inside a step fails only that step's
        requests (or one request, for its own output processing). Only a broken device or a failed
        KV-cache invariant raises, as EngineFatalError."""
        try:
            return self._step()
        except (EngineFatalError, ExecutorDeadError):
            raise
        except Exception as exc:  # noqa: BLE001 - the last-resort guard
            return self._recover(exc)
        finally:
            self.core.active = []

    def _step(self) -> list[RequestOutput]:
        use_async = self.async_scheduling and not self.beams.groups  # beam groups step synchronously
        self._admit_compiled()  # requests whose grammar finished compiling join the scheduler
        outputs = self.output.take_pending()
        results = self.core.step(async_scheduling=use_async)
        touched: dict[str, ParentState] = {}
        for result in results:
            self._process(result, touched)
        if not results and not use_async:
            self.beams.after_step(progressed=False)
        return outputs + self.output.collect(touched)

    def _process(self, result: StepResult, touched: dict[str, ParentState]) -> None:
        """Emit a finished step's tokens, finish what stopped, and advance beams and drafts."""
        if result.output is None:
            self._process_failure(result, touched)
            return
        out = self.output
        for rid, logprobs in result.output.beam_logprobs.items():
            self.beams.record(rid, logprobs)
        for rid, rows in result.output.prompt_logprobs.items():
            seq = out.seqs.get(rid)
            if seq is not None and seq.request is result.scheduled.get(rid):
                try:
                    out.prompt_logprobs(seq, rows)
                except Exception as exc:  # noqa: BLE001 - this request only
                    logger.error("prompt logprobs of request %s failed", rid, exc_info=exc)
                    out.fail(seq, f"{type(exc).__name__}: {exc}")
                    touched[seq.parent_id] = out.parents[seq.parent_id]
        for rid, toks in result.output.sampled.items():
            seq = out.seqs.get(rid)
            if seq is not None and seq.request is result.scheduled.get(rid):  # not a new request reusing the id
                touched[seq.parent_id] = out.parents[seq.parent_id]
                try:
                    out.emit(seq, toks)
                    self._check_grammar(seq)
                except Exception as exc:  # noqa: BLE001 - detokenizer, stop strings, logprobs: this request only
                    logger.error("output processing of request %s failed", rid, exc_info=exc)
                    out.fail(seq, f"{type(exc).__name__}: {exc}")
        for req in result.finished:
            seq = out.seq_of(req)
            if seq is not None:
                out.finish(seq, req)
                touched[seq.parent_id] = out.parents[seq.parent_id]
        if self.spec is not None:
            self.spec.after_step(result.so, result.finished)
        self.beams.after_step()

    def _check_grammar(self, seq: SequenceState) -> None:
        """A grammar's end stops its sequence ("stop"); a token it rejected fails it. Under async
        scheduling the step after may already hold a row for the sequence: stopping it here drops that
        row's token (its placeholder goes, and the scheduler ignores the row's result)."""
        req = seq.request
        ended, error = self.structured.after_tokens(req)
        if error is not None:
            logger.error("request %s: %s", req.request_id, error)
            self.output.fail(seq, f"structured output: {error}")
        elif ended:
            self.scheduler.stop_request(req, len(req.output_token_ids), None)
            self.output.finish(seq, req)

    def _process_failure(self, result: StepResult, touched: dict[str, ParentState]) -> None:
        msg = f"{type(result.error).__name__}: {result.error}"
        for req in result.failed:
            if self.beams.owns(req.request_id):
                self.beams.fail(req.request_id, msg)
                continue
            seq = self.output.seqs.get(req.request_id)
            if seq is None:  # a beam whose group an earlier beam of this step already failed
                continue
            self.output.finish(seq, req)
            parent = self.output.parents[seq.parent_id]
            parent.error = msg
            touched[parent.request_id] = parent

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """An exception escaped a step: fail the requests of the steps it was handling (every
        unfinished request when it came from scheduling itself), drop the in-flight step, and go
        on if the KV cache's invariants still hold; otherwise EngineFatalError."""
        if _device_broken(exc):
            raise EngineFatalError(f"the device failed: {type(exc).__name__}: {exc}") from exc
        self.scheduler.stats.step_errors += 1
        logger.error("engine step failed outside its fault isolation; failing its requests", exc_info=exc)
        msg = f"{type(exc).__name__}: {exc}"
        outputs = self.output.take_pending()
        touched: dict[str, ParentState] = {}
        try:
            if not self.core.active:
                raise exc  # not inside a known step: nobody can say which request caused it
            for result in self.core.fail_active(exc):
                self._process_failure(result, touched)
        except Exception:  # noqa: BLE001 - fail everything that is still unfinished
            self.beams.fail_all(msg)
            self.output.fail_all(msg, touched)
            self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ERROR)
        try:
            self.scheduler.check_integrity()
        except Exception as bad:  # noqa: BLE001
            raise EngineFatalError(f"KV cache invariants broken after a failed step: {bad}") from exc
        return outputs + self.output.collect(touched)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.scheduler.snapshot()
        st = self.scheduler.stats
        out.update(
            kv_cache_dtype=str(self.resolved.kv_cache_dtype).removeprefix("torch."),
            quantization=self.resolved.quantization.source if self.resolved.quantization else None,
            kv_bytes_moved=self.executor.bytes_moved,
            spec_acceptance_rate=st.spec_accepted / st.spec_proposed if st.spec_proposed else 0.0,
            spec_mean_tokens_per_step=(st.spec_accepted + st.spec_verify_steps) / st.spec_verify_steps
            if st.spec_verify_steps else 0.0,
        )
        out["timings_s"] = dict(self.core.timings)
        counts = self.structured.counts()
        if counts is not None:
            out[STRUCTURED_STATS_KEY] = counts
        return out

    def check_health(self) -> None:
        """Raise ExecutorDeadError if the executor can run no more steps (a worker died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
