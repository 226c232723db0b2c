"""LLMEngine: add_request / abort_request / step(): schedule -> build -> run -> sample -> update."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from tallyserve.config import EngineArgs
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.engine.beam_search import BeamSearchDriver, BeamSearchParams
from tallyserve.engine.output_processor import ParentState, SequenceState, make_detokenizer, record_logprobs
from tallyserve.engine.spec_runner import SpecDecodeRunner
from tallyserve.models.loader import load_model, resolve_model
from tallyserve.outputs import RequestOutput
from tallyserve.attention.backend import get_attn_backend
from tallyserve.request import Request, RequestStatus
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.runner.model_runner import (
    ModelRunner,
    determine_num_blocks,
    num_host_blocks,
    resolve_device,
    resolve_dtype,
)
from tallyserve.runner.rejection_sampler import TokenSample, verify_drafts
from tallyserve.runner.sampler import PendingSamplerOutput, Sampler, host_tensor
from tallyserve.sampling_params import SamplingParams, check_unicode
from tallyserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict[str, Any]]
TIMING_KEYS = ("schedule", "build", "forward", "sample", "wait", "update")


class EngineFatalError(RuntimeError):
    """The device or the engine's own invariants are broken: the loop must stop (and say why).
    Nothing a request carries raises this; a request's failure ends only that request."""


def _device_broken(exc: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "device-side assert" in str(exc))


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens may still be on the device."""

    so: SchedulerOutput
    resolved: dict[str, list[TokenSample]]  # rows sampled on the host (drafts verified)
    seqs: dict[str, Optional[SequenceState]] = field(default_factory=dict)  # who sampled, by identity
    token_ids: Optional[torch.Tensor] = None  # device tensor of the plain rows' tokens
    token_index: dict[str, int] = field(default_factory=dict)  # request id -> row of token_ids
    pending: Optional[PendingSamplerOutput] = None

    def result(self) -> dict[str, list[TokenSample]]:
        out = dict(self.resolved)
        if self.pending is not None:
            host = self.pending.result()
            for rid, i in self.token_index.items():
                out[rid] = [TokenSample(host.token_ids[i], host.logprobs[i], host.top_logprobs[i])]
        return out


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
        torch.manual_seed(args.seed)
        model = load_model(resolved, args.load_format, self.dtype, self.device, args.seed,
                           get_attn_backend("auto", self.device))
        if self.device.type == "cuda":
            model.enable_fused_kernels()  # fused add+RMSNorm, RoPE, SiLU-mul; TALLYSERVE_FUSED_KERNELS=0 turns off
        num_blocks = determine_num_blocks(args, mc, self.device, self.dtype, model)
        host_blocks = num_host_blocks(args, mc, self.dtype) if args.enable_prefix_caching else 0
        self.config = args.resolve(mc, num_blocks, host_blocks)
        self.model_config = mc
        cc, sc = self.config.cache_config, self.config.scheduler_config
        self.scheduler = Scheduler(sc, cc)
        self.runner = ModelRunner(model, mc, num_blocks, cc.block_size, self.device, self.dtype, host_blocks,
                                  use_cuda_graph=not args.enforce_eager, max_num_seqs=sc.max_num_seqs,
                                  max_model_len=sc.max_model_len)
        self.sampler = Sampler(generator=torch.Generator(device=self.device).manual_seed(args.seed))
        self.eos_token_ids = self._eos_ids()
        self.spec = SpecDecodeRunner.create(args, self, num_blocks) if args.speculative_config else None
        self.beams = BeamSearchDriver(self.scheduler, self.tokenizer, self.eos_token_ids)
        self._parents: dict[str, ParentState] = {}
        self._seqs: dict[str, SequenceState] = {}
        self._pending: list[RequestOutput] = []  # outputs of requests ended outside a step
        self.timings = {k: 0.0 for k in TIMING_KEYS}
        # Offline callers that only want finished outputs skip building the rest every step.
        self.final_outputs_only = False
        # Test hook: called with each SchedulerOutput before the forward pass (may raise).
        self.fault_injector: Optional[Callable[[SchedulerOutput], None]] = None
        # Async scheduling: the next step is scheduled and launched before this one's tokens are
        # read back (not with speculative decoding; beam groups run synchronously).
        self.async_scheduling = args.async_scheduling
        if self.async_scheduling is None:  # default: on where it overlaps something (CUDA)
            self.async_scheduling = self.device.type == "cuda" and self.spec is None
        self._inflight: Optional[InFlightStep] = None
        self._active: list[SchedulerOutput] = []  # steps the current step() call scheduled or completes
        self.current_step_tokens = 0  # tokens of the step being run now (0 between steps): for health

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
                    priority: int = 0, arrival_time: Optional[float] = None) -> None:
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.logprobs is not None and params.logprobs > self.config.args.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({self.config.args.max_logprobs}), got {params.logprobs}")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}")
        max_n = self.config.scheduler_config.max_num_seqs
        if params.n > max_n:
            raise ValueError(f"n must be at most max_num_seqs ({max_n}): all n sequences of a request run "
                             f"in one batch; got {params.n}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        text, ids = self.process_prompt(prompt)
        max_model_len = self.config.scheduler_config.max_model_len
        if len(ids) >= max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_model_len}, so it must be shorter")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
        parent = ParentState(request_id, text, ids, params, metrics={"arrival_time": arrival_time or time.time()})
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child_params = params if (i == 0 or params.seed is None) else params.clone(seed=params.seed + i)
            req = Request(child_id, ids, child_params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                          priority=priority, arrival_time=arrival_time)
            gen = None
            if child_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(child_params.seed)
            seq = SequenceState(req, i, request_id, make_detokenizer(self.tokenizer, req), gen)
            parent.children.append(seq)
        for seq in parent.children:
            self.scheduler.add_request(seq.request)
            self._seqs[seq.request.request_id] = seq
        self._parents[request_id] = parent

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            ids = [c.request.request_id for c in parent.children if c.finish_reason is None]
            for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
                self._finish_seq(self._seqs[req.request_id], req)
            self._pending.append(self._pop_if_finished(parent))

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending) or bool(self.beams.groups) or self._inflight is not None

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
        self._active = []
        try:
            return self._step()
        except EngineFatalError:
            raise
        except Exception as exc:  # noqa: BLE001 - the last-resort guard
            return self._recover(exc)
        finally:
            self.current_step_tokens = 0

    def _step(self) -> list[RequestOutput]:
        if self.async_scheduling and not self.beams.groups:
            return self._step_async()
        if self._inflight is not None:  # going synchronous (a beam group arrived): drain first
            outputs, self._pending = self._pending, []
            touched: dict[str, ParentState] = {}
            self._complete(self._inflight, touched)
            self._inflight = None
            return outputs + self._collect_finished(touched)
        t0 = time.perf_counter()
        so = self._schedule(async_scheduling=False)
        self.timings["schedule"] += time.perf_counter() - t0
        outputs, self._pending = self._pending, []
        if so.is_empty:
            if so.kv_transfers:  # e.g. copy-on-write of forked beams queued since the last step
                self.runner.apply_transfers(so.kv_transfers)
                self.scheduler.update(so, {})
            self.beams.after_step(progressed=False)
            return outputs
        touched = {}
        launched, failure = self._launch(so)
        if failure is not None:
            self._fail_step(so, failure[0], touched, transfers_ran=failure[1])
        else:
            self._complete(launched, touched)
        return outputs + self._collect_finished(touched)

    def _step_async(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        so = self._schedule(async_scheduling=True)
        self.timings["schedule"] += time.perf_counter() - t0
        outputs, self._pending = self._pending, []
        touched: dict[str, ParentState] = {}
        launched, failure = None, None
        if not so.is_empty:
            launched, failure = self._launch(so)
        elif so.kv_transfers:
            self.runner.apply_transfers(so.kv_transfers)
        prev, self._inflight = self._inflight, launched
        if prev is not None:
            self._complete(prev, touched)
        elif so.is_empty and so.kv_transfers:
            self.scheduler.update(so, {})
        if failure is not None:  # after the previous step's results: what stopped there stays stopped
            self._fail_step(so, failure[0], touched, transfers_ran=failure[1])
        return outputs + self._collect_finished(touched)

    def _schedule(self, async_scheduling: bool) -> SchedulerOutput:
        so = self.scheduler.schedule(async_scheduling=async_scheduling)
        self._active.append(so)
        self.current_step_tokens = so.total_tokens
        return so

    def _launch(self, so: SchedulerOutput) -> tuple[Optional[InFlightStep], Optional[tuple[Exception, bool]]]:
        """Transfers, batch, forward and sampling of one step, queued on the device; the host
        results come from ``_complete``. On failure: (None, (exception, whether the transfers ran));
        the caller fails this step's requests (only its own: one failed step never ends the loop)."""
        t1 = time.perf_counter()
        try:
            self.runner.apply_transfers(so.kv_transfers)
        except Exception as exc:  # noqa: BLE001 - the promised host copies never happened
            return None, (exc, False)
        prev = self._inflight
        try:
            batch = ForwardBatch.build(so, self.runner.block_size, self.device,
                                       prev.token_index if prev is not None else None)
            self.scheduler.stats.forward_tokens += batch.num_tokens
            ledger.check_step(so.total_tokens, batch.num_tokens, so.max_num_batched_tokens)
            t2 = time.perf_counter()
            self.timings["build"] += t2 - t1
            if self.fault_injector is not None:
                self.fault_injector(so)
            logits = self.runner.execute(batch, prev.token_ids if prev is not None else None)
            t3 = time.perf_counter()
            self.timings["forward"] += t3 - t2
            step = self._sample(so, logits)
            self.timings["sample"] += time.perf_counter() - t3
            return step, None
        except Exception as exc:  # noqa: BLE001 - one failed step fails only its own requests
            return None, (exc, True)

    def _complete(self, step: InFlightStep, touched: dict[str, ParentState]) -> None:
        """Wait for a launched step's sampled tokens, then update, emit and finish."""
        t4 = time.perf_counter()
        self._active.append(step.so)
        try:
            sampled = step.result()
        except Exception as exc:  # noqa: BLE001 - e.g. a device error surfacing at the copy
            self._fail_step(step.so, exc, touched)
            return
        t5 = time.perf_counter()
        self.timings["wait"] += t5 - t4
        so = step.so
        finished = self.scheduler.update(so, {rid: [t.token_id for t in toks] for rid, toks in sampled.items()})
        for rid, toks in sampled.items():
            seq = self._seqs.get(rid)
            if seq is not None and seq is step.seqs.get(rid):  # not a new request reusing the id
                touched[seq.parent_id] = self._parents[seq.parent_id]
                try:
                    self._emit_tokens(seq, toks)
                except Exception as exc:  # noqa: BLE001 - detokenizer, stop strings, logprobs: this request only
                    logger.error("output processing of request %s failed", rid, exc_info=exc)
                    self._fail_seq(seq, f"{type(exc).__name__}: {exc}")
        for req in finished:
            seq = self._seqs.get(req.request_id)
            if seq is not None and seq.request is req:
                self._finish_seq(seq, req)
                touched[seq.parent_id] = self._parents[seq.parent_id]
        if self.spec is not None:
            self.spec.after_step(so, finished)
        self.beams.after_step()
        self.timings["update"] += time.perf_counter() - t5

    @torch.inference_mode()  # the logits are inference tensors; min_tokens bans edit them in place
    def _sample(self, so: SchedulerOutput, logits: torch.Tensor) -> InFlightStep:
        """Queue the sampling of a step's logits. Plain rows stay on the device (their tokens feed
        the next async step); beam rows and draft verification are resolved here, on the host."""
        entries = [e for e in so.requests if e.sample]
        row, plain, plain_rows, resolved = 0, [], [], {}
        for e in entries:
            n = e.num_sample_rows
            if self.beams.owns(e.request_id):  # beam search picks tokens per group, after the step
                self.beams.record(e.request_id, logits[row])
                row += n
                continue
            if e.num_output_tokens < e.sampling_params.min_tokens:
                banned = list(self.eos_token_ids) + list(e.sampling_params.stop_token_ids)
                if banned:
                    logits[row:row + n].index_fill_(1, host_tensor(banned, logits.device), float("-inf"))
            if e.num_draft_tokens:
                gen = self._seqs[e.request_id].generator or self.sampler._shared_generator(logits.device)
                q = self.spec.draft_probs(e.request_id, e.num_draft_tokens)
                resolved[e.request_id] = verify_drafts(logits[row:row + n], e.draft_token_ids, e.sampling_params, gen, q)
            else:
                plain.append(e)
                plain_rows.append(row)
            row += n
        step = InFlightStep(so, resolved, seqs={e.request_id: self._seqs.get(e.request_id) for e in entries})
        if plain:
            sub = logits if len(plain_rows) == logits.shape[0] else logits[host_tensor(plain_rows, logits.device)]
            gens = [self._seqs[e.request_id].generator for e in plain]
            tensors = self.sampler.sample_tensors(sub, [e.sampling_params for e in plain], gens)
            step.token_ids = tensors.token_ids
            step.token_index = {e.request_id: i for i, e in enumerate(plain)}
            step.pending = tensors.to_host()
        return step

    def _emit_tokens(self, seq: SequenceState, samples: list[TokenSample]) -> None:
        """Logprobs and stop-safe text for the tokens the scheduler appended this step."""
        req = seq.request
        new = req.output_token_ids[seq.num_emitted:]  # sampled tokens only, no placeholders
        for i, token in enumerate(new):
            record_logprobs(seq, samples[i], self.tokenizer)
            seq.num_emitted += 1
            seq.text += seq.detokenizer.update([token])  # stop-safe text only
            if seq.detokenizer.finished:
                del req.all_token_ids[req.num_prompt_tokens + seq.num_emitted:]
                req.num_output_placeholders = 0
                if not req.is_finished():
                    req.stop_reason = seq.detokenizer.stop_reason
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
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

    def _fail_step(self, so: SchedulerOutput, exc: Exception, touched: dict[str, ParentState],
                   transfers_ran: bool = True, count: bool = True) -> None:
        if not count:
            pass
        elif isinstance(exc, ledger.LedgerError):
            self.scheduler.stats.ledger_violations += 1
            logger.error("ledger violation, failing step %d: %s", so.step_id, exc)
        else:
            self.scheduler.stats.step_errors += 1
            logger.error("engine step %d failed", so.step_id, exc_info=exc)
        msg = f"{type(exc).__name__}: {exc}"
        for req in self.scheduler.fail_step(so, msg, transfers_ran):
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
        inflight, self._inflight = self._inflight, None
        steps = list(self._active) + ([inflight.so] if inflight is not None else [])
        try:
            if not self._active:
                raise exc  # not inside a known step: nobody can say which request caused it
            for so in {id(s): s for s in steps}.values():
                self._fail_step(so, exc, touched, count=False)
        except Exception:  # noqa: BLE001 - fail everything that is still unfinished
            self._fail_everything(msg, touched)
        try:
            self.scheduler.kv.release_step()
            self.scheduler.kv.check_integrity()
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
        s = self.scheduler
        out: dict[str, Any] = s.stats.as_dict()
        out.update(
            num_free_blocks=s.kv.num_free_blocks,
            num_total_blocks=s.kv.num_total_blocks,
            num_cached_blocks=s.kv.pool.num_cached_blocks,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            block_evictions=s.kv.pool.num_evictions,
        )
        host = s.kv.host
        out.update(
            num_host_blocks=host.num_blocks if host else 0,
            host_blocks_offloaded=host.num_offloaded if host else 0,
            host_blocks_restored=self.scheduler.stats.host_hit_tokens // s.kv.block_size,
            kv_bytes_moved=self.runner.bytes_moved,
        )
        st = self.scheduler.stats
        out.update(
            spec_acceptance_rate=st.spec_accepted / st.spec_proposed if st.spec_proposed else 0.0,
            spec_mean_tokens_per_step=(st.spec_accepted + st.spec_verify_steps) / st.spec_verify_steps
            if st.spec_verify_steps else 0.0,
        )
        out["timings_s"] = dict(self.timings)
        return out
