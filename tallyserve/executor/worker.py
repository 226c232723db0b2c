"""A tensor-parallel worker: one process per rank, holding that rank's model shard, KV cache and
(on rank 0) the sampler.

Rank 0 talks to the engine through a pipe; every message it gets is broadcast to the other ranks
with one collective (`broadcast_object_list` over a gloo group, so it also reaches ranks on other
machines), every rank runs it, and only rank 0 answers. Messages:

  ("step", SchedulerOutput, KVTransfers, draft_probs) -> ("ok", num_forward_tokens, ModelRunnerOutput | None)
  ("transfers", KVTransfers)                         -> ("ok", 0, None)
  ("kv", KVConnectorMetadata)                        -> ("ok", 0, [KVConnectorOutput of each rank])
  ("kv_meta",)                                       -> ("ok", 0, [NIXL metadata of each rank])
  ("shutdown",)                                      -> the worker exits

A step that fails the same way on every rank (a ledger mismatch, a bad batch) answers
("error", exception type name, message); a rank that fails alone leaves the others in a collective until its timeout,
which rank 0 then reports, and the engine declares the executor dead.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from tallyserve.core import ledger
from tallyserve import envs
from tallyserve.distributed import parallel_state as ps
from tallyserve.runner.model_runner import ModelRunner
from tallyserve.runner.cpu_threads import keep_freed_memory
from tallyserve.runner.memory import record_memory_baseline
from tallyserve.runner.model_runner import apply_matmul_dtype, determine_num_blocks, num_host_blocks
from tallyserve.models.loader import load_model
from tallyserve.attention.backend import get_attn_backend

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its shard (picklable: sent to spawned processes)."""

    resolved: Any  # the engine's ResolvedEngine (executor/resolve.py)
    rank: int
    init_method: str
    device: str  # "cpu" or "cuda:N" (the local GPU of this rank)
    num_threads: int

    @property
    def args(self) -> Any:
        return self.resolved.args


def _init(spec: WorkerSpec):
    """Join the group, load this rank's shard and size its KV pool (the smallest over ranks)."""
    args, device = spec.args, torch.device(spec.device)
    if device.type == "cpu":
        torch.set_num_threads(spec.num_threads)

        keep_freed_memory()  # large activations reuse freed memory instead of faulting in new pages
    ps.init_tensor_parallel(args.tensor_parallel_size, spec.rank, spec.init_method,
                            timeout_s=args.worker_timeout, device=device)
    group = ps.get_tp_group() if ps.default_backend(device) == "gloo" else dist.new_group(backend="gloo")
    resolved = spec.resolved.model
    torch.manual_seed(args.seed)
    record_memory_baseline(device)  # what other processes hold on the card is not ours
    model = load_model(resolved, args.load_format, spec.resolved.dtype, device, args.seed, get_attn_backend("auto", device),
                       tp_rank=spec.rank, tp_size=args.tensor_parallel_size, quantization=args.quantization,
                       enable_expert_parallel=args.enable_expert_parallel)
    model.enable_fused_kernels()  # CUDA, or CPU float32 (TALLYSERVE_FUSED_KERNELS=0 turns off)
    apply_matmul_dtype(model, args.dtype, device)  # the CPU's dtype="bfloat16": bf16 projections
    kv_dtype = spec.resolved.kv_cache_dtype
    blocks = torch.tensor([determine_num_blocks(args, resolved.model_config, device, kv_dtype, model,
                                                args.tensor_parallel_size)], dtype=torch.int64)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=group)
    host_blocks = num_host_blocks(args, resolved.model_config, kv_dtype, args.tensor_parallel_size) \
        if args.enable_prefix_caching else 0
    return resolved, model, int(blocks.item()), host_blocks, group


def _build_runner(spec: WorkerSpec, resolved, model, config) -> tuple[ModelRunner, Any]:
    """This rank's runner, and its half of disaggregated serving (None without a KV transfer config)."""
    sc, cc = config.scheduler_config, config.cache_config
    device = torch.device(spec.device)
    runner = ModelRunner(model, resolved.model_config, cc.num_blocks, cc.block_size, device,
                       spec.resolved.kv_cache_dtype, cc.num_host_blocks,
                       use_cuda_graph=not spec.args.enforce_eager,
                       max_num_seqs=sc.max_num_seqs, max_model_len=sc.max_model_len,
                       eos_token_ids=spec.resolved.eos_token_ids, seed=spec.args.seed,
                       use_cascade_attn=not spec.args.disable_cascade_attn)
    kv_connector = None
    if spec.args.kv_transfer_config is not None:  # this rank's own heads, its own NIXL agent
        from tallyserve.distributed.kv_transfer.nixl_connector import NixlConnectorWorker

        kv_connector = NixlConnectorWorker(spec.args.kv_transfer_config, cc.block_size, tp_rank=spec.rank)
        kv_connector.register_kv_caches(runner.kv_caches)
    return runner, kv_connector


def _kv_step(conn, msg: tuple, group) -> tuple:
    """Disaggregated serving: every rank loads its own heads' KV; rank 0 gathers what finished."""
    if msg[0] == "kv_meta":
        mine = conn.metadata()
    else:
        if msg[1]:
            conn.start_load_kv(msg[1])
        mine = conn.get_finished()
    box = [None] * dist.get_world_size(group)
    dist.all_gather_object(box, mine, group=group)
    return ("ok", 0, box)


def _run_step(runner, kv_connector, rank: int, msg: tuple, group=None) -> tuple:
    kind = msg[0]
    if kind in ("kv", "kv_meta"):
        return _kv_step(kv_connector, msg, group)
    if kind == "transfers":
        runner.apply_transfers(msg[1])
        return ("ok", 0, None)
    _, so, transfers, draft_probs = msg
    runner.apply_transfers(transfers)
    batch = runner.prepare(so, None)
    ledger.check_step(so.total_tokens, batch.num_tokens, so.max_num_batched_tokens)  # every rank, same answer
    handle = runner.launch(so, batch, None, draft_probs)
    return ("ok", batch.num_tokens, handle.result() if rank == 0 else None)


def worker_main(spec: WorkerSpec, conn) -> None:
    """Entry point of a worker process (``conn``: rank 0's pipe to the engine, None elsewhere)."""
    logging.basicConfig(level=envs.TALLYSERVE_WORKER_LOG_LEVEL)
    rank = spec.rank
    try:
        resolved, model, num_blocks, host_blocks, group = _init(spec)
        config = None
        if rank == 0:
            conn.send(("sized", num_blocks, host_blocks))
            config = conn.recv()
        box = [config]
        dist.broadcast_object_list(box, src=0, group=group)
        runner, kv_connector = _build_runner(spec, resolved, model, box[0])
        if rank == 0:
            conn.send(("ready",))
    except BaseException as exc:  # noqa: BLE001 - tell the engine why, then exit
        if conn is not None:
            conn.send(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    _serve(runner, kv_connector, rank, conn, group)
    # Leave without running interpreter teardown: the process group's C++ threads may still be
    # referenced (model layers, the group) and tearing them down at exit can abort the process.
    logging.shutdown()
    os._exit(0)


def _serve(runner, kv_connector, rank: int, conn, group) -> None:
    while True:
        box: list[Optional[tuple]] = [None]
        if rank == 0:
            try:
                box[0] = conn.recv()
            except (EOFError, OSError):  # the engine is gone: take the other ranks down with us
                box[0] = ("shutdown",)
        dist.broadcast_object_list(box, src=0, group=group)
        msg = box[0]
        if msg[0] == "shutdown":
            break
        try:
            reply = _run_step(runner, kv_connector, rank, msg, group)
        except Exception as exc:  # noqa: BLE001 - the same on every rank: a failed step, not a dead worker
            logger.error("rank %d: step failed", rank, exc_info=exc)
            reply = ("error", type(exc).__name__, str(exc))
        if rank == 0:
            conn.send(reply)

    ps.destroy()
