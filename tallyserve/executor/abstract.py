"""The Executor interface: what the engine core needs from whatever runs the model.

Three implementations share it: the in-process model executor (one ModelRunner), the
multi-process executor (one worker per tensor-parallel rank) and the simulator's cost-model
executor. A step goes ``apply_transfers`` -> ``prepare`` (the batch, whose token count the
core checks against the ledger) -> ``launch`` (forward and sampling, queued) -> the handle's
``result()`` (a ModelRunnerOutput on the host). An executor may split ``launch`` in two
(``launch_forward``, then the sampling): structured outputs fill their bitmask in between.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from tallyserve.core.kv_cache_manager import KVTransfers
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.runner.outputs import ModelRunnerOutput
from tallyserve.distributed.kv_transfer.base import KVConnectorOutput

if TYPE_CHECKING:
    from tallyserve.distributed.kv_transfer.base import KVConnectorOutput


class ExecutorDeadError(RuntimeError):
    """The executor can run no more steps (a worker process died or stopped answering): the engine
    loop stops, every pending request fails, and /health says why."""


class PreparedStep(Protocol):
    num_tokens: int  # query tokens the forward pass will compute (the ledger's forward count)


class StepHandle(Protocol):
    """A launched step. ``token_index``/``token_ids``: where its sampled tokens sit on the
    device, for the placeholder rows of the next async step."""

    def result(self) -> ModelRunnerOutput: ...


class DeferredSample(Protocol):
    """A launched forward pass whose sampling waits (runner/outputs.py: PendingForward)."""

    def sample(self, so: SchedulerOutput) -> StepHandle: ...


class Executor(ABC):
    #: True when a launched step overlaps the host's work (CUDA): async scheduling pays off.
    overlaps_host: bool = False
    #: True when ``launch_forward`` splits a step: a grammar's bitmask is filled while its forward
    #: pass runs, so async scheduling need not hold grammar rows back until their token is in.
    defers_sampling: bool = False

    @abstractmethod
    def apply_transfers(self, transfers: KVTransfers) -> None:
        """Offloads, restores and partial-block copies the scheduler queued for this step."""

    @abstractmethod
    def prepare(self, so: SchedulerOutput, prev: Optional[StepHandle]) -> PreparedStep:
        """Build the step's batch (placeholder rows read ``prev``'s sampled tokens)."""

    @abstractmethod
    def launch(self, so: SchedulerOutput, prepared: PreparedStep, prev: Optional[StepHandle],
               draft_probs: Optional[dict[str, torch.Tensor]] = None) -> StepHandle:
        """Queue the forward pass and sampling; the handle's result() waits for them."""

    def launch_forward(self, so: SchedulerOutput, prepared: PreparedStep, prev: Optional[StepHandle],
                       draft_probs: Optional[dict[str, torch.Tensor]] = None) -> DeferredSample:
        """Queue only the forward pass; the result's ``sample(so)`` queues the sampling later (the
        core fills a grammar bitmask in between). Only where ``defers_sampling``."""
        raise NotImplementedError(f"{type(self).__name__} cannot split a step's forward pass and sampling")

    @property
    def bytes_moved(self) -> int:
        """KV bytes copied between the device and host pools so far."""
        return 0

    def kv_connector_step(self, metadata) -> "KVConnectorOutput":
        """Disaggregated serving: start the loads of ``metadata`` (KVConnectorMetadata) on the
        workers and return what finished. An executor without a KV connector fails every load
        (the scheduler then recomputes or fails the request, as configured)."""
        out = KVConnectorOutput()
        for load in getattr(metadata, "loads", ()):
            out.failed_recving[load.request_id] = "this executor has no KV connector"
        return out

    def kv_transfer_metadata(self, rank: int) -> Optional[dict]:
        """The NIXL metadata of tensor-parallel rank ``rank`` (what consumers fetch), or None."""
        return None

    def flush_transfers(self) -> None:
        """Run KV moves queued by a step that launched nothing (no-op where they ran at once)."""

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (a worker died)."""

    def shutdown(self) -> None:
        """Release workers and devices; idempotent."""

    def describe(self) -> dict[str, Any]:
        return {"executor": type(self).__name__}
