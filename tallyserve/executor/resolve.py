"""The one resolve step of an engine's configuration: EngineArgs in, everything the engine, the executors
and the workers build from out (the model's files and config, the device, the dtypes, the EOS ids, the
tensor-parallel split), each checked once, before any process starts or weight loads. The engine
(`LLMEngine`), a worker-only node (`tallyserve serve --node-rank R`) and every tensor-parallel worker
take the result; nobody resolves again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tallyserve.config import EngineArgs
from tallyserve.config.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from tallyserve.config.model import ModelConfig, check_tensor_parallel
from tallyserve.config.quantization import Fp8Config, resolve_quantization
from tallyserve.models.loader import ResolvedModel, resolve_model
from tallyserve.models.moe import check_expert_parallel
from tallyserve.tokenizer import load_tokenizer as load_tokenizer_from


@dataclass(frozen=True)
class ResolvedEngine:
    args: EngineArgs  # validated
    model: ResolvedModel
    device: torch.device
    dtype: torch.dtype  # the model's (activations, norms, attention)
    kv_cache_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    served_model_name: str
    tokenizer_dir: Optional[str]
    quantization: Optional[Fp8Config] = None  # the projections' FP8 scheme (quantization="fp8", an FP8 checkpoint)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.model_config


def resolve_engine(args: EngineArgs, load_tokenizer: bool = True) -> tuple[ResolvedEngine, Any]:
    """(the resolved configuration, the engine's tokenizer or None). ValueError for any argument that does
    not fit, before anything is loaded. The tokenizer's EOS id joins the model's; a worker-only node
    (``load_tokenizer=False``) keeps the model's (only rank 0 samples)."""
    args.validate()
    model = resolve_model(args.model, args.load_format)
    mc = model.model_config
    if args.max_model_len is not None and args.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len ({args.max_model_len}) is larger than the model's "
                         f"max_position_embeddings ({mc.max_position_embeddings})")
    check_tensor_parallel(mc, args.tensor_parallel_size)  # before any process or weight
    if mc.moe_layers:
        check_expert_parallel(mc.num_experts, args.tensor_parallel_size, args.enable_expert_parallel,
                              mc.moe_intermediate_size)
    window, longest = mc.sliding_window, args.max_model_len or mc.max_position_embeddings
    if window is not None and window < longest:
        raise ValueError(f"{mc.architecture} with sliding_window={window}: sliding-window attention is not "
                         f"supported yet, and full attention gives other tokens once a sequence is longer than the "
                         f"window; serve it with max_model_len <= {window} (exact there)")
    quantization = resolve_quantization(mc.hf_config, args.quantization)  # likewise: unsupported schemes fail here
    device = resolve_device(args.device)
    tokenizer_dir = args.tokenizer or model.tokenizer_dir
    tokenizer = load_tokenizer_from(tokenizer_dir) if load_tokenizer else None
    eos = list(mc.eos_token_ids)
    tok_eos = tokenizer.eos_token_id if tokenizer is not None else None
    if tok_eos is not None and tok_eos not in eos:
        eos.append(tok_eos)
    resolved = ResolvedEngine(args, model, device, resolve_dtype(args.dtype, device),
                              resolve_kv_cache_dtype(args.dtype, device, args.kv_cache_dtype), tuple(eos),
                              args.served_model_name or model.served_name, tokenizer_dir, quantization)
    return resolved, tokenizer
