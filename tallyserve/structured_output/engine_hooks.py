"""How LLMEngine runs structured-output requests, kept out of the engine's own module.

A request whose grammar is still compiling waits here, outside the scheduler: it is not
scheduled and the ledger charges nothing for it. Each step the engine admits the requests whose
grammar is ready (one matcher per sequence) and fails those whose grammar did not compile.
After a step, a sequence whose matcher reached its end state is finished ("stop"), and one whose
token the grammar rejected (it cannot happen while the bitmask is applied) fails with an error.
Under async scheduling the step after it may already hold a row for that sequence: stopping it
here drops that row's token (its placeholder goes, and the scheduler ignores the row's result).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Optional

from tallyserve.request import RequestStatus
from tallyserve.structured_output.compiler import CompileTicket
from tallyserve.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from tallyserve.engine.llm_engine import LLMEngine
    from tallyserve.engine.output_processor import ParentState, SequenceState
    from tallyserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long an otherwise idle step waits for a grammar to finish compiling.
IDLE_COMPILE_WAIT_S = 0.05


class StructuredOutputHooks:
    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        pin = engine.device.type == "cuda" and engine.executor.defers_sampling  # the runner shares this process
        self.manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size,
                                               engine.eos_token_ids, pin_memory=pin,
                                               limits=engine.structured_outputs_limits)
        self.waiting: dict[str, CompileTicket] = {}  # parent request id -> its grammar's compile
        # The offline LLM compiles at add time, so a bad constraint is a ValueError there; the
        # server validates before adding, and the engine itself never waits for a compile.
        self.compile_at_add = False

    def submit(self, params: "SamplingParams") -> Optional[CompileTicket]:
        """At add time: start compiling; ValueError now if the constraint is already known bad."""
        so = params.structured_outputs
        if so is None:
            return None
        ticket = self.manager.submit(so)
        fut = ticket.future
        if self.compile_at_add or (fut.done() and fut.exception() is not None):
            try:
                self.manager.result(ticket)  # raises the ValueError of a constraint that does not compile
            except BaseException:
                self.manager.release(ticket)
                raise
        return ticket

    def admit(self, parent: "ParentState", ticket: Optional[CompileTicket]) -> None:
        """Schedule the parent's sequences now if their grammar is ready, else park them."""
        if ticket is not None and not ticket.future.done():
            self.waiting[parent.request_id] = ticket
            return
        self._start(parent, ticket)

    def _start(self, parent: "ParentState", ticket: Optional[CompileTicket]) -> None:
        engine = self.engine
        if ticket is not None:
            try:
                compiled = self.manager.result(ticket)
            finally:
                self.manager.release(ticket)
            for seq in parent.children:
                kind = seq.request.sampling_params.structured_outputs.kind
                self.manager.register(seq.request.request_id, compiled, kind)
        for seq in parent.children:
            engine.scheduler.add_request(seq.request)

    def poll(self) -> None:
        """Before a step: admit parked requests whose grammar is ready, fail those that failed.
        When nothing else can run, wait a moment for a compile instead of spinning."""
        if not self.waiting:
            return
        engine = self.engine
        if not engine.scheduler.requests and not engine.core.has_inflight():
            concurrent.futures.wait([t.future for t in self.waiting.values()], timeout=IDLE_COMPILE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for rid, ticket in list(self.waiting.items()):
            if not ticket.future.done():
                continue
            del self.waiting[rid]
            parent = engine._parents.get(rid)
            if parent is None:
                self.manager.release(ticket)
                continue
            try:
                self._start(parent, ticket)
            except Exception as exc:  # noqa: BLE001 - the constraint did not compile (or was cancelled)
                self.end_parked(parent, RequestStatus.FINISHED_ERROR, str(exc))

    def abort(self, request_id: str) -> bool:
        """Abort a parked request (its compile is cancelled if nobody else waits for it); False
        if it is not parked."""
        ticket = self.waiting.pop(request_id, None)
        if ticket is not None:
            self.manager.release(ticket)
        parent = self.engine._parents.get(request_id)
        if ticket is None or parent is None:
            return False
        self.end_parked(parent, RequestStatus.FINISHED_ABORTED, None)
        return True

    def end_parked(self, parent: "ParentState", status: RequestStatus, error: Optional[str]) -> None:
        engine = self.engine
        for seq in parent.children:
            seq.request.status = status
            seq.request.error = error
            engine._finish_seq(seq, seq.request, flush=False)
        parent.error = error
        engine._pending.append(engine._pop_if_finished(parent))

    def after_tokens(self, seq: "SequenceState") -> None:
        """After a sequence's new tokens were emitted: follow them with its matcher; end the
        sequence when the grammar is done, fail it if the grammar rejected a token."""
        req = seq.request
        if req.is_finished() or not self.manager.has(req.request_id):
            return
        if not self.manager.sync(req):
            msg = self.manager.error(req.request_id)
            logger.error("request %s: %s", req.request_id, msg)
            self.engine._fail_seq(seq, f"structured output: {msg}")
        elif self.manager.is_terminated(req.request_id):
            self.engine.scheduler.stop_request(req, len(req.output_token_ids), None)
            self.engine._finish_seq(seq, req)

    def forget(self, request_id: str) -> None:
        self.manager.forget(request_id)

    def shutdown(self) -> None:
        self.manager.shutdown()
