"""The multi-process executor: one worker process per tensor-parallel rank (see `worker.py`).

The scheduler runs once, here. Each step's frozen SchedulerOutput goes to rank 0's worker through
a pipe (pickled once); rank 0 broadcasts it to every rank with one gloo collective; every rank
builds the same batch, checks the ledger and runs its shard of the forward pass (the all-reduces
are inside the model); rank 0 gathers the logits, samples and answers.

A worker that dies or stops answering (its process exits, or no answer within `worker_timeout`)
makes the executor dead: `ExecutorDeadError`, which stops the engine loop, fails every pending
request and turns /health to 503. Workers are daemon processes and exit when the engine's pipe
closes, so no worker outlives the engine.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from multiprocessing.connection import wait
from typing import Any, Optional

import torch

from tallyserve.config import EngineArgs, EngineConfig
from tallyserve.core import ledger
from tallyserve.core.kv_cache_manager import KVTransfers
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.executor.abstract import Executor, ExecutorDeadError
from tallyserve.executor.worker import WorkerSpec, worker_main
from tallyserve.executor.resolve import ResolvedEngine
from tallyserve.runner.model_runner import kv_bytes_per_block
from tallyserve.runner.outputs import ModelRunnerOutput
from tallyserve.distributed.kv_transfer.base import RankReports

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(args: EngineArgs) -> range:
    """The ranks this node runs: tensor_parallel_size / nnodes consecutive ones."""
    per_node = args.tensor_parallel_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def init_method(args: EngineArgs) -> str:
    return f"tcp://{args.dist_init_addr}" if args.dist_init_addr else f"tcp://127.0.0.1:{_free_port()}"


def spawn_workers(r: ResolvedEngine, method: str) -> tuple[list[mp.Process], Optional[Any]]:
    """Start this node's workers; returns them and rank 0's engine-side pipe (None off node 0)."""
    args, device = r.args, r.device
    ranks = local_ranks(args)
    if device.type == "cuda" and len(ranks) > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size} needs {len(ranks)} GPUs on this node, "
                         f"but {torch.cuda.device_count()} are visible")
    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // len(ranks))
    procs, engine_end = [], None
    for local, rank in enumerate(ranks):
        dev = f"cuda:{local}" if device.type == "cuda" else "cpu"
        conn = None
        if rank == 0:
            engine_end, conn = ctx.Pipe()
        spec = WorkerSpec(r, rank, method, dev, threads)
        proc = ctx.Process(target=worker_main, args=(spec, conn), name=f"tallyserve-tp-rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
        if conn is not None:
            conn.close()  # the child holds its end; EOF here then means the child is gone
    return procs, engine_end


class MultiprocExecutor(Executor):
    overlaps_host = False  # steps complete synchronously (async scheduling needs rank 0's tokens on every rank)

    def __init__(self, procs: list[mp.Process], conn, timeout: float, bytes_per_block: int) -> None:
        self.procs = procs
        self.conn = conn
        self.timeout = timeout
        self.bytes_per_block = bytes_per_block
        self._bytes_moved = 0
        self._transfers: Optional[KVTransfers] = None
        self._dead: Optional[str] = None
        self.broadcast_s = 0.0  # host seconds spent sending steps to rank 0 (the rest is the collective)
        self.kv_ranks = None  # disaggregated serving: per-rank reports merged across steps
        self._kv_meta: list[dict] = []

    @classmethod
    def create(cls, r: ResolvedEngine) -> tuple["MultiprocExecutor", EngineConfig]:
        args, resolved = r.args, r.model
        procs, conn = spawn_workers(r, init_method(args))
        per_block = kv_bytes_per_block(resolved.model_config, args.block_size, r.kv_cache_dtype,
                                       args.tensor_parallel_size)
        ex = cls(procs, conn, args.worker_timeout, per_block)
        try:
            _, num_blocks, host_blocks = ex._recv("sized", STARTUP_TIMEOUT_S)
            config = args.resolve(resolved.model_config, num_blocks, host_blocks)
            conn.send(config)
            ex._recv("ready", STARTUP_TIMEOUT_S)
        except BaseException:
            ex.shutdown()
            raise
        logger.info("tensor parallelism: %d workers ready, %d KV blocks per rank", len(procs), num_blocks)
        if args.kv_transfer_config is not None:
            ex.kv_ranks = RankReports(args.tensor_parallel_size)
            ex._send(("kv_meta",))
            ex._kv_meta = ex._recv("ok", ex.timeout)[2]
        return ex, config

    def kv_connector_step(self, metadata):
        """Every rank starts its share of the loads and reports; a load (or a producer's send) counts
        as done only once every rank reported it, so no block is freed while one rank still writes."""
        if self.kv_ranks is None:
            return super().kv_connector_step(metadata)
        self._send(("kv", metadata))
        reply = self._recv("ok", self.timeout)
        if reply[0] == "error":
            raise RuntimeError(f"{reply[1]} (KV connector on the tensor-parallel workers): {reply[2]}")
        return self.kv_ranks.merge(reply[2])

    def kv_transfer_metadata(self, rank: int):
        return self._kv_meta[rank] if 0 <= rank < len(self._kv_meta) else None

    # ----------------------------------------------------------------- talking to rank 0
    def _recv(self, expect: str, timeout: float) -> tuple:
        """Rank 0's next answer; ExecutorDeadError if a local worker exits or time runs out."""
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: p for p in self.procs}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._die(f"tensor-parallel workers did not answer within {timeout:.0f}s")
            ready = wait([self.conn, *sentinels], timeout=left)
            if self.conn in ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    self._die("tensor-parallel rank 0 closed its pipe")
                if msg[0] == "failed":
                    self._die(f"a tensor-parallel worker failed to start: {msg[1]}")
                if msg[0] != expect and msg[0] != "error":
                    self._die(f"unexpected worker message {msg[0]!r} (expected {expect!r})")
                return msg
            for s in ready:
                if s in sentinels:
                    p = sentinels[s]
                    self._die(f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}")

    def _die(self, reason: str) -> None:
        self._dead = reason
        logger.error("executor dead: %s", reason)
        self.shutdown()
        raise ExecutorDeadError(reason)

    def _send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        t0 = time.perf_counter()
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            self._die("tensor-parallel rank 0 is gone (its pipe is closed)")
        self.broadcast_s += time.perf_counter() - t0

    # ----------------------------------------------------------------- Executor
    def apply_transfers(self, transfers: KVTransfers) -> None:
        """Sent with the step that follows; alone when no step follows (an empty step's copies)."""
        self._bytes_moved += (len(transfers.offloads) + len(transfers.restores)) * self.bytes_per_block
        self._transfers = transfers

    def prepare(self, so: SchedulerOutput, prev=None) -> "_Counted":
        return _Counted(sum(len(e.token_ids) for e in so.requests))

    def launch(self, so: SchedulerOutput, prepared: "_Counted", prev=None,
               draft_probs: Optional[dict[str, torch.Tensor]] = None) -> "_Done":
        transfers, self._transfers = self._transfers or KVTransfers(), None
        self._send(("step", so, transfers, draft_probs or {}))
        reply = self._recv("ok", self.timeout)
        if reply[0] == "error":
            _, name, message = reply
            if name == "LedgerError":
                raise ledger.LedgerError(message)
            raise RuntimeError(f"{name} (on the tensor-parallel workers): {message}")
        if reply[1] != prepared.num_tokens:  # what the workers' batch builder built, against the charge
            raise ledger.LedgerError(f"ledger mismatch: the workers computed {reply[1]} tokens, "
                                     f"the step charged {prepared.num_tokens}")
        return _Done(reply[2])

    def flush_transfers(self) -> None:
        if self._transfers:
            transfers, self._transfers = self._transfers, None
            self._send(("transfers", transfers))
            self._recv("ok", self.timeout)

    @property
    def bytes_moved(self) -> int:
        return self._bytes_moved

    def check_health(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        for p in self.procs:
            if not p.is_alive():
                self._die(f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}")

    def shutdown(self) -> None:
        """Ask rank 0 to stop every rank; terminate whatever does not exit in time. Idempotent."""
        if self.conn is not None:
            try:
                self.conn.send(("shutdown",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self._dead is None:
            self._dead = "the executor was shut down"

    def describe(self) -> dict[str, Any]:
        return {"executor": "multiproc", "workers": [p.pid for p in self.procs]}


class _Counted:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output
        self.token_ids = None
        self.token_index: dict[str, int] = {}

    def result(self) -> ModelRunnerOutput:
        return self.output
