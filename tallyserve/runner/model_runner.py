"""ModelRunner: owns the model and the paged KV cache; executes one ForwardBatch."""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

from tallyserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from tallyserve.core.kv_cache_manager import KVCopy, KVTransfers, cdiv
from tallyserve.models.model_config import ModelConfig
from tallyserve.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 by default on GPU, float32 on CPU (exact parity and fast CPU kernels)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim
    return per_token * block_size * elem


def determine_num_blocks(args: EngineArgs, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Blocks of the KV pool: the override, else a byte budget (CPU) or free GPU memory."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    per_block = kv_bytes_per_block(model_config, args.block_size, dtype)
    if args.kv_cache_memory_bytes is not None:
        budget = args.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        # Leave room for activations of a full token budget (logits dominate at large vocab).
        tokens = args.max_num_batched_tokens or 8192
        activations = tokens * (model_config.vocab_size * 4 + model_config.intermediate_size * 12)
        budget = int(total * args.gpu_memory_utilization) - used - activations
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    # More blocks than every sequence could ever fill is wasted memory.
    ceiling = cdiv(model_config.max_position_embeddings, args.block_size) * args.max_num_seqs
    num_blocks = min(num_blocks, max(ceiling, 1))
    if num_blocks < 1:
        raise ValueError(
            f"not enough memory for a single KV block ({per_block} bytes); "
            "raise gpu_memory_utilization or kv_cache_memory_bytes"
        )
    return int(num_blocks)


def num_host_blocks(args: EngineArgs, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Blocks of the host KV tier: kv_offload_bytes over the bytes of one block (0 = no tier)."""
    if not args.kv_offload_bytes:
        return 0
    return max(args.kv_offload_bytes // kv_bytes_per_block(model_config, args.block_size, dtype), 1)


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, num_host_blocks: int = 0) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        shape = model.get_kv_cache_shape(num_blocks, block_size)
        layers = model_config.num_hidden_layers
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.host_kv_caches: list[torch.Tensor] = []
        if num_host_blocks:
            host_shape = model.get_kv_cache_shape(num_host_blocks, block_size)
            pin = device.type == "cuda"
            self.host_kv_caches = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]
        self.bytes_per_block = kv_bytes_per_block(model_config, block_size, dtype)
        self.bytes_moved = 0

    def copy_blocks(self, copies: Sequence[KVCopy]) -> None:
        """Partial reuse: copy the leading slots of cached blocks into the requests' new blocks."""
        for c in copies:
            for cache in self.kv_caches:
                cache[:, c.dst, : c.num_tokens] = cache[:, c.src, : c.num_tokens]

    @torch.inference_mode()
    def apply_transfers(self, moves: KVTransfers) -> None:
        """A step's block moves, in order: offloads (device -> host), restores, partial copies."""
        if moves.offloads:
            src = torch.tensor([c.src for c in moves.offloads], device=self.device)
            dst = torch.tensor([c.dst for c in moves.offloads])
            for dev, host in zip(self.kv_caches, self.host_kv_caches):
                host[:, dst] = dev[:, src].to("cpu")
        if moves.restores:
            src = torch.tensor([c.src for c in moves.restores])
            dst = torch.tensor([c.dst for c in moves.restores], device=self.device)
            for dev, host in zip(self.kv_caches, self.host_kv_caches):
                dev[:, dst] = host[:, src].to(self.device, non_blocking=True)
        self.bytes_moved += (len(moves.offloads) + len(moves.restores)) * self.bytes_per_block
        self.copy_blocks(moves.copies)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the forward pass; return float32 logits of the sampled rows (S, vocab)."""
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])
