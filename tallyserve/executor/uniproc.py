"""The in-process executor: one ModelRunner on this process's device."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tallyserve.attention.backend import get_attn_backend
from tallyserve.config import EngineConfig
from tallyserve.core.kv_cache_manager import KVTransfers
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.executor.abstract import Executor
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.executor.resolve import ResolvedEngine
from tallyserve.models.loader import load_model
from tallyserve.runner.model_runner import (ModelRunner, apply_matmul_dtype, determine_num_blocks, num_host_blocks,
                                            warm_up_full_budget)
from tallyserve.runner.cpu_threads import CpuThreadGovernor, cpu_task_pool, keep_freed_memory
from tallyserve.runner.memory import record_memory_baseline
from tallyserve.runner.outputs import AsyncModelRunnerOutput, PendingForward
from tallyserve.distributed.kv_transfer.factory import make_connector


class UniProcExecutor(Executor):
    defers_sampling = True

    def __init__(self, runner: ModelRunner, kv_connector=None) -> None:
        self.runner = runner
        self.overlaps_host = runner.device.type == "cuda"
        self.kv_connector = kv_connector  # the worker half of disaggregated serving, if configured
        # on the CPU the forward's thread count follows the cores other processes leave free
        self.cpu_threads = CpuThreadGovernor(task_pool=cpu_task_pool(runner.model)) \
            if runner.device.type == "cpu" else None
        if runner.device.type == "cpu":
            keep_freed_memory()  # large activations reuse freed memory instead of faulting in new pages
        if kv_connector is not None:
            kv_connector.register_kv_caches(runner.kv_caches)

    @classmethod
    def create(cls, r: ResolvedEngine) -> tuple["UniProcExecutor", EngineConfig]:
        """Load the model on the resolved device, size the KV pool, resolve the engine config, build the runner."""
        args, resolved, device, dtype, eos_token_ids = r.args, r.model, r.device, r.dtype, r.eos_token_ids
        mc = resolved.model_config
        record_memory_baseline(device)  # what other processes hold on the card is not ours
        model = load_model(resolved, args.load_format, dtype, device, args.seed, get_attn_backend("auto", device),
                           quantization=args.quantization, enable_expert_parallel=args.enable_expert_parallel)
        # fused add+RMSNorm, RoPE, SiLU-mul (CUDA; CPU float32); TALLYSERVE_FUSED_KERNELS=0 turns off
        model.enable_fused_kernels()
        apply_matmul_dtype(model, args.dtype, device)  # the CPU's dtype="bfloat16": bf16 projections
        kv_dtype = r.kv_cache_dtype  # the model's, or bf16 with them on the CPU
        num_blocks = determine_num_blocks(args, mc, device, kv_dtype, model)
        host_blocks = num_host_blocks(args, mc, kv_dtype) if args.enable_prefix_caching else 0
        config = args.resolve(mc, num_blocks, host_blocks)
        sc = config.scheduler_config
        runner = ModelRunner(model, mc, num_blocks, args.block_size, device, kv_dtype, host_blocks,
                             use_cuda_graph=not args.enforce_eager, max_num_seqs=sc.max_num_seqs,
                             max_model_len=sc.max_model_len, eos_token_ids=eos_token_ids, seed=args.seed,
                             use_cascade_attn=not args.disable_cascade_attn)
        warm_up_full_budget(model, args, mc, device)  # CUDA: a full prefill step's memory and kernels, before serving
        connector = None
        if args.kv_transfer_config is not None:
            connector = make_connector(args.kv_transfer_config, args.block_size, role="worker")
        return cls(runner, connector), config

    def kv_connector_step(self, metadata):
        if self.kv_connector is None:
            return super().kv_connector_step(metadata)
        if metadata:
            self.kv_connector.start_load_kv(metadata)
        return self.kv_connector.get_finished()

    def kv_transfer_metadata(self, rank: int):
        conn = self.kv_connector
        return conn.metadata() if conn is not None and hasattr(conn, "metadata") and rank == 0 else None

    def shutdown(self) -> None:
        if self.cpu_threads is not None:
            self.cpu_threads.close()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def apply_transfers(self, transfers: KVTransfers) -> None:
        self.runner.apply_transfers(transfers)

    def prepare(self, so: SchedulerOutput, prev: Optional[AsyncModelRunnerOutput]) -> ForwardBatch:
        return self.runner.prepare(so, prev)

    def launch(self, so: SchedulerOutput, prepared: ForwardBatch, prev: Optional[AsyncModelRunnerOutput],
               draft_probs: Optional[dict[str, torch.Tensor]] = None) -> AsyncModelRunnerOutput:
        if self.cpu_threads is not None:
            self.cpu_threads.step(so.total_tokens)
        return self.runner.launch(so, prepared, prev, draft_probs)

    def launch_forward(self, so: SchedulerOutput, prepared: ForwardBatch, prev: Optional[AsyncModelRunnerOutput],
                       draft_probs: Optional[dict[str, torch.Tensor]] = None) -> PendingForward:
        if self.cpu_threads is not None:
            self.cpu_threads.step(so.total_tokens)
        return self.runner.launch_forward(so, prepared, prev, draft_probs)

    @property
    def bytes_moved(self) -> int:
        return self.runner.bytes_moved

    def describe(self) -> dict[str, Any]:
        return {"executor": "uniproc", "device": str(self.runner.device)}
