"""LLMEngine: requests in, RequestOutputs out. The step loop itself is EngineCore's
(schedule -> ledger check -> executor -> update); this class adds what users see on top of it:
prompts and tokenization, n > 1, detokenization and stop strings, logprobs, beam search groups,
speculative drafts, and the last-resort guard that keeps the loop alive."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Union

import torch

from tallyserve.config import EngineArgs, check_prompt_length
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.core.scheduler import Scheduler
from tallyserve.engine.beam_search import BeamSearchDriver, BeamSearchParams
from tallyserve.engine.core import EngineCore, StepResult
from tallyserve.engine.output_processor import (ParentState, SequenceState, make_detokenizer, record_logprobs,
                                                record_prompt_logprobs)
from tallyserve.engine.spec_runner import SpecDecodeRunner
from tallyserve.executor.abstract import ExecutorDeadError
from tallyserve.executor.uniproc import UniProcExecutor
from tallyserve.models.llama import check_tensor_parallel
from tallyserve.models.loader import resolve_model
from tallyserve.outputs import RequestOutput
from tallyserve.request import Request, RequestStatus
from tallyserve.runner.model_runner import resolve_device, resolve_dtype
from tallyserve.runner.rejection_sampler import TokenSample
from tallyserve.sampling_params import SamplingParams, check_unicode
from tallyserve.structured_output.limits import StructuredOutputsLimits
from tallyserve.structured_output.engine_hooks import StructuredOutputHooks
from tallyserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict[str, Any]]


class EngineFatalError(RuntimeError):
    """The device or the engine's own invariants are broken: the loop must stop (and say why).
    Nothing a request carries raises this; a request's failure ends only that request."""


def _device_broken(exc: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "device-side assert" in str(exc))


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        resolved = resolve_model(args.model, args.load_format)
        mc = resolved.model_config
        if args.max_model_len is not None and args.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({args.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({mc.max_position_embeddings})"
            )
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.served_model_name = args.served_model_name or resolved.served_name
        self.tokenizer: Optional[Tokenizer] = load_tokenizer(args.tokenizer or resolved.tokenizer_dir)
        self.model_config = mc
        self.eos_token_ids = self._eos_ids()
        torch.manual_seed(args.seed)
        if args.tensor_parallel_size > 1:
            check_tensor_parallel(mc, args.tensor_parallel_size)  # before any process or weight
            from tallyserve.executor.multiproc import MultiprocExecutor

            self.executor, self.config = MultiprocExecutor.create(args, resolved, self.device, self.dtype,
                                                                  self.eos_token_ids)
        else:
            self.executor, self.config = UniProcExecutor.create(args, resolved, self.device, self.dtype,
                                                                self.eos_token_ids)
        self.runner = getattr(self.executor, "runner", None)  # the in-process ModelRunner, if any
        self.kv_connector = None  # the scheduler half of disaggregated serving
        if args.kv_transfer_config is not None:
            from tallyserve.distributed.kv_transfer.factory import make_connector

            self.kv_connector = make_connector(args.kv_transfer_config, args.block_size, role="scheduler")
        self.scheduler = Scheduler(self.config.scheduler_config, self.config.cache_config, self.kv_connector)
        self.spec = None
        if args.speculative_config:
            self.spec = SpecDecodeRunner.create(args, self.scheduler, mc, self.device, self.dtype,
                                                self.config.cache_config.num_blocks)
        self.core = EngineCore(self.scheduler, self.executor, drafts=self.spec)
        self.beams = BeamSearchDriver(self.scheduler, self.tokenizer, self.eos_token_ids)
        self.structured_outputs_limits = StructuredOutputsLimits.from_args(args)
        self.structured = StructuredOutputHooks(self)  # grammars: compile off the loop, bitmasks per step
        self.core.grammar = self.structured.manager
        self.scheduler.grammar_waits = not self.executor.defers_sampling  # async: see Scheduler.grammar_waits
        if self.spec is not None:
            self.spec.structured = self.structured.manager
        self._parents: dict[str, ParentState] = {}
        self._seqs: dict[str, SequenceState] = {}
        self._pending: list[RequestOutput] = []  # outputs of requests ended outside a step
        # Offline callers that only want finished outputs skip building the rest every step.
        self.final_outputs_only = False
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

    def _eos_ids(self) -> tuple[int, ...]:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return tuple(ids)

    # ----------------------------------------------------------------- requests
    def process_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A prompt string, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            ids = self.tokenizer.encode(check_unicode("prompt", prompt))
            if not ids:
                raise ValueError("prompt must not be empty")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        vocab = self.model_config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range [0, {vocab})")
        return list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    kv_transfer_params: Optional[dict] = None) -> None:
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        max_logprobs = min(self.config.args.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({max_logprobs}), got {k}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}), got {bad[0]}")
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError("bad_words needs a tokenizer: pass bad_words_token_ids instead")
            params = params.with_bad_words_tokenized(self.tokenizer)
        max_n = self.config.scheduler_config.max_num_seqs
        if params.n > max_n:
            raise ValueError(f"n must be at most max_num_seqs ({max_n}): all n sequences of a request run "
                             f"in one batch; got {params.n}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        text, ids = self.process_prompt(prompt)
        max_model_len = self.config.scheduler_config.max_model_len
        check_prompt_length(len(ids), max_model_len)
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
        if isinstance(prompt, dict) and "kv_transfer_params" in prompt:  # the server passes them with the prompt
            kv_transfer_params = prompt["kv_transfer_params"]
        if kv_transfer_params is not None:
            from tallyserve.distributed.kv_transfer.factory import check_request_params

            kv_transfer_params = check_request_params(self.kv_connector, kv_transfer_params, len(ids), params.n)
            if kv_transfer_params and kv_transfer_params.get("do_remote_prefill") and params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be computed from a remote prefill's KV: ask the prefill "
                                 "instance for them, or send the request without kv_transfer_params")
        grammar = self.structured.submit(params)  # compiles in the compile pool; ValueError if known bad
        parent = ParentState(request_id, text, ids, params, metrics={"arrival_time": arrival_time or time.time()},
                             prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None else None)
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child_params = params if (i == 0 or params.seed is None) else params.clone(seed=params.seed + i)
            if i and child_params.prompt_logprobs is not None:  # the children share one prompt: the first scores it
                child_params = child_params.clone(prompt_logprobs=None)
            req = Request(child_id, ids, child_params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                          priority=priority, arrival_time=arrival_time)
            req.kv_transfer_params = kv_transfer_params
            seq = SequenceState(req, i, request_id, make_detokenizer(self.tokenizer, req))
            parent.children.append(seq)
        for seq in parent.children:
            self._seqs[seq.request.request_id] = seq
        self._parents[request_id] = parent
        self.structured.admit(parent, grammar)  # scheduled now, or once its grammar is compiled

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.get(rid)
            if parent is None or self.structured.abort(rid):
                continue
            ids = [c.request.request_id for c in parent.children if c.finish_reason is None]
            for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
                self._finish_seq(self._seqs[req.request_id], req)
            self._pending.append(self._pop_if_finished(parent))

    def has_unfinished_requests(self) -> bool:
        xfer = self.scheduler.kv_xfer  # disaggregated serving: loads running, blocks held for a consumer
        return bool(self._parents) or bool(self._pending) or bool(self.beams.groups) or self.core.has_inflight() \
            or (xfer is not None and xfer.has_pending())

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
        self.structured.poll()  # requests whose grammar finished compiling join the scheduler
        outputs, self._pending = self._pending, []
        results = self.core.step(async_scheduling=use_async)
        touched: dict[str, ParentState] = {}
        for result in results:
            self._process(result, touched)
        if not results and not use_async:
            self.beams.after_step(progressed=False)
        return outputs + self._collect_finished(touched)

    def _process(self, result: StepResult, touched: dict[str, ParentState]) -> None:
        """Emit a finished step's tokens, finish what stopped, and advance beams and drafts."""
        if result.output is None:
            self._process_failure(result, touched)
            return
        for rid, logprobs in result.output.beam_logprobs.items():
            self.beams.record(rid, logprobs)
        for rid, rows in result.output.prompt_logprobs.items():
            seq = self._seqs.get(rid)
            if seq is not None and seq.request is result.scheduled.get(rid):
                try:
                    record_prompt_logprobs(self._parents[seq.parent_id], rows, self.tokenizer)
                except Exception as exc:  # noqa: BLE001 - this request only
                    logger.error("prompt logprobs of request %s failed", rid, exc_info=exc)
                    self._fail_seq(seq, f"{type(exc).__name__}: {exc}")
                    touched[seq.parent_id] = self._parents[seq.parent_id]
        for rid, toks in result.output.sampled.items():
            seq = self._seqs.get(rid)
            if seq is not None and seq.request is result.scheduled.get(rid):  # not a new request reusing the id
                touched[seq.parent_id] = self._parents[seq.parent_id]
                try:
                    self._emit_tokens(seq, toks)
                    self.structured.after_tokens(seq)
                except Exception as exc:  # noqa: BLE001 - detokenizer, stop strings, logprobs: this request only
                    logger.error("output processing of request %s failed", rid, exc_info=exc)
                    self._fail_seq(seq, f"{type(exc).__name__}: {exc}")
        for req in result.finished:
            seq = self._seqs.get(req.request_id)
            if seq is not None and seq.request is req:
                self._finish_seq(seq, req)
                touched[seq.parent_id] = self._parents[seq.parent_id]
        if self.spec is not None:
            self.spec.after_step(result.so, result.finished)
        self.beams.after_step()

    def _process_failure(self, result: StepResult, touched: dict[str, ParentState]) -> None:
        msg = f"{type(result.error).__name__}: {result.error}"
        for req in result.failed:
            if self.beams.owns(req.request_id):
                self.beams.fail(req.request_id, msg)
                continue
            seq = self._seqs.get(req.request_id)
            if seq is None:  # a beam whose group an earlier beam of this step already failed
                continue
            self._finish_seq(seq, req)
            parent = self._parents[seq.parent_id]
            parent.error = msg
            touched[parent.request_id] = parent

    def _emit_tokens(self, seq: SequenceState, samples: list[TokenSample]) -> None:
        """Logprobs and stop-safe text for the tokens the scheduler appended this step."""
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
                    self._finish_seq(seq, req)
                    if self.spec is not None:
                        self.spec.forget(req.request_id)
                return

    def _fail_seq(self, seq: SequenceState, msg: str) -> None:
        """End one sequence with an error (its own output processing failed); its blocks are freed."""
        req = seq.request
        if not req.is_finished():
            req.error = msg
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self._finish_seq(seq, req, flush=False)
        parent = self._parents.get(seq.parent_id)
        if parent is not None:
            parent.error = msg

    def _finish_seq(self, seq: SequenceState, req: Request, flush: bool = True) -> None:
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
        self._seqs.pop(req.request_id, None)
        self.structured.forget(req.request_id)

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """An exception escaped a step: fail the requests of the steps it was handling (every
        unfinished request when it came from scheduling itself), drop the in-flight step, and go
        on if the KV cache's invariants still hold; otherwise EngineFatalError."""
        if _device_broken(exc):
            raise EngineFatalError(f"the device failed: {type(exc).__name__}: {exc}") from exc
        self.scheduler.stats.step_errors += 1
        logger.error("engine step failed outside its fault isolation; failing its requests", exc_info=exc)
        msg = f"{type(exc).__name__}: {exc}"
        outputs, self._pending = self._pending, []
        touched: dict[str, ParentState] = {}
        try:
            if not self.core.active:
                raise exc  # not inside a known step: nobody can say which request caused it
            for result in self.core.fail_active(exc):
                self._process_failure(result, touched)
        except Exception:  # noqa: BLE001 - fail everything that is still unfinished
            self._fail_everything(msg, touched)
        try:
            self.scheduler.check_integrity()
        except Exception as bad:  # noqa: BLE001
            raise EngineFatalError(f"KV cache invariants broken after a failed step: {bad}") from exc
        return outputs + self._collect_finished(touched)

    def _fail_everything(self, msg: str, touched: dict[str, ParentState]) -> None:
        self.beams.fail_all(msg)
        for parent in list(self._parents.values()):
            for seq in parent.children:
                if seq.finish_reason is None:
                    self._fail_seq(seq, msg)
            parent.error = msg
            touched[parent.request_id] = parent
        leftover = [rid for rid in self.scheduler.requests]
        self.scheduler.finish_requests(leftover, RequestStatus.FINISHED_ERROR)

    def _collect_finished(self, touched: dict[str, ParentState]) -> list[RequestOutput]:
        """Outputs of the requests that progressed; only the finished ones when nobody streams."""
        if self.final_outputs_only:
            return [self._pop_if_finished(p) for p in touched.values() if p.finished]
        return [self._pop_if_finished(parent) for parent in touched.values()]

    def _pop_if_finished(self, parent: ParentState) -> RequestOutput:
        if parent.finished:
            self._parents.pop(parent.request_id, None)
            parent.metrics["finished_time"] = time.time()
        return parent.to_output()

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.scheduler.snapshot()
        st = self.scheduler.stats
        out.update(
            kv_bytes_moved=self.executor.bytes_moved,
            spec_acceptance_rate=st.spec_accepted / st.spec_proposed if st.spec_proposed else 0.0,
            spec_mean_tokens_per_step=(st.spec_accepted + st.spec_verify_steps) / st.spec_verify_steps
            if st.spec_verify_steps else 0.0,
        )
        out["timings_s"] = dict(self.core.timings)
        return out

    def check_health(self) -> None:
        """Raise ExecutorDeadError if the executor can run no more steps (a worker died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
