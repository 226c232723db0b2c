"""The simulator's executor: the engine core's step, priced by a cost model on a virtual clock.

`prepare` is the simulator's batch builder: it counts the rows' query tokens (or builds the real
ForwardBatch with `build_batches`) and checks each row against the request it computes, so the
core's ledger check compares a real count with the charge. `launch` advances the virtual clock
by the cost model's step time and samples synthetic tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from tallyserve.core import ledger
from tallyserve.core.kv_cache_manager import KVTransfers
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.executor.abstract import Executor
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.runner.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from tallyserve.sim.simulator import Simulator


@dataclass(frozen=True)
class _Counted:
    num_tokens: int


class _Done:
    """A simulated step: its tokens are known at launch (the clock already moved)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output
        self.token_index: dict[str, int] = {}
        self.token_ids: Optional[torch.Tensor] = None

    def result(self) -> ModelRunnerOutput:
        return self.output


class CostModelExecutor(Executor):
    def __init__(self, sim: "Simulator") -> None:
        self.sim = sim

    def apply_transfers(self, transfers: KVTransfers) -> None:
        """KV moves cost nothing extra here: the cost model prices the step they belong to."""

    def prepare(self, so: SchedulerOutput, prev: Optional[_Done]) -> _Counted:
        if self.sim.opts.build_batches:  # placeholder rows would read the previous step's tokens
            src = {e.request_id: 0 for e in so.requests}
            block_size = self.sim.config.cache_config.block_size
            return _Counted(ForwardBatch.build(so, block_size, torch.device("cpu"), src).num_tokens)
        reqs = self.sim.scheduler.requests
        total = 0
        for e in so.requests:
            req = reqs[e.request_id]
            computed, num_tokens = req.num_computed_tokens, req.num_tokens
            if so.async_scheduled:  # the scheduler already advanced it (and added a placeholder)
                computed, num_tokens = computed - e.num_tokens, num_tokens - e.sample
            if e.start_position != computed or e.num_tokens > ledger.query_tokens(
                    num_tokens, e.start_position, e.num_draft_tokens):
                raise ledger.LedgerError(f"{e.request_id}: row computes {e.num_tokens} tokens from position "
                                         f"{e.start_position}, request has {req.num_computed_tokens}/{req.num_tokens}")
            total += len(e.token_ids)
        return _Counted(total)

    def launch(self, so: SchedulerOutput, prepared: _Counted, prev: Optional[_Done],
               draft_probs: Optional[dict[str, torch.Tensor]] = None) -> _Done:
        now = self.sim.record_step(so, overlapped=prev is not None)  # prev: the step still in flight
        return _Done(ModelRunnerOutput(self.sim.sample(so, now)))
