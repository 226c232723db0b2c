"""Executors: what runs the model for the engine core (in process, one worker per tensor-parallel
rank, or the simulator's cost model)."""

from tallyserve.executor.abstract import Executor

__all__ = ["Executor"]
