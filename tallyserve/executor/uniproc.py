"""The in-process executor: one ModelRunner on this process's device."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tallyserve.attention.backend import get_attn_backend
from tallyserve.config import EngineArgs, EngineConfig
from tallyserve.core.kv_cache_manager import KVTransfers
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.executor.abstract import Executor
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.models.loader import ResolvedModel, load_model
from tallyserve.runner.model_runner import ModelRunner, determine_num_blocks, num_host_blocks
from tallyserve.runner.outputs import AsyncModelRunnerOutput


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.overlaps_host = runner.device.type == "cuda"

    @classmethod
    def create(cls, args: EngineArgs, resolved: ResolvedModel, device: torch.device, dtype: torch.dtype,
               eos_token_ids: tuple[int, ...]) -> tuple["UniProcExecutor", EngineConfig]:
        """Load the model on ``device``, size the KV pool, resolve the engine config, build the runner."""
        mc = resolved.model_config
        model = load_model(resolved, args.load_format, dtype, device, args.seed, get_attn_backend("auto", device))
        if device.type == "cuda":
            model.enable_fused_kernels()  # fused add+RMSNorm, RoPE, SiLU-mul; TALLYSERVE_FUSED_KERNELS=0 turns off
        num_blocks = determine_num_blocks(args, mc, device, dtype, model)
        host_blocks = num_host_blocks(args, mc, dtype) if args.enable_prefix_caching else 0
        config = args.resolve(mc, num_blocks, host_blocks)
        sc = config.scheduler_config
        runner = ModelRunner(model, mc, num_blocks, args.block_size, device, dtype, host_blocks,
                             use_cuda_graph=not args.enforce_eager, max_num_seqs=sc.max_num_seqs,
                             max_model_len=sc.max_model_len, eos_token_ids=eos_token_ids, seed=args.seed)
        return cls(runner), config

    def apply_transfers(self, transfers: KVTransfers) -> None:
        self.runner.apply_transfers(transfers)

    def prepare(self, so: SchedulerOutput, prev: Optional[AsyncModelRunnerOutput]) -> ForwardBatch:
        return self.runner.prepare(so, prev)

    def launch(self, so: SchedulerOutput, prepared: ForwardBatch, prev: Optional[AsyncModelRunnerOutput],
               draft_probs: Optional[dict[str, torch.Tensor]] = None) -> AsyncModelRunnerOutput:
        return self.runner.launch(so, prepared, prev, draft_probs)

    @property
    def bytes_moved(self) -> int:
        return self.runner.bytes_moved

    def describe(self) -> dict[str, Any]:
        return {"executor": "uniproc", "device": str(self.runner.device)}
