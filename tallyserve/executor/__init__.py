"""Executors: what runs the model for the engine core (in process, one worker per tensor-parallel
rank, or the simulator's cost model)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tallyserve.executor.abstract import Executor

if TYPE_CHECKING:
    from tallyserve.config import EngineConfig
    from tallyserve.executor.resolve import ResolvedEngine

__all__ = ["Executor", "create_executor"]


def create_executor(resolved: "ResolvedEngine") -> tuple[Executor, "EngineConfig"]:
    """The executor for a resolved configuration: one worker process per rank under tensor parallelism,
    else the model in this process; with the engine config it sized."""
    if resolved.args.tensor_parallel_size > 1:
        from tallyserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor.create(resolved)
    from tallyserve.executor.uniproc import UniProcExecutor

    return UniProcExecutor.create(resolved)
