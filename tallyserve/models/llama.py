"""Decoder-only Llama-family model over a paged KV cache: Llama, Mistral, Qwen2, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral (their sparse layers' MLP is ``models/moe.FusedMoE``).

They differ only in configuration, read from ``ModelConfig``:
  * Qwen2: biases on the q/k/v projections (not on o_proj);
  * Qwen3: per-head RMSNorm of q and k before RoPE, explicit head_dim;
  * Llama: optional bias on all four attention projections (``attention_bias``) and MLP;
  * tied or untied input/output embeddings.
Parameter names match Hugging Face checkpoints, so a safetensors state dict loads by name.

The model is flat-token: ``forward`` takes T token ids with explicit positions (requests laid out
one after another, as ``AttentionMetadata`` describes) and returns T hidden states.

Tensor parallelism (``tp_size > 1``; one process per rank, see ``tallyserve.distributed``): each
rank holds ``num_attention_heads / tp_size`` query heads, its KV heads (``num_local_kv_heads``:
``num_key_value_heads / tp_size`` when there are at least ``tp_size`` of them, else the one KV
head its query heads use, replicated across ``tp_size / num_key_value_heads`` ranks), an
``intermediate_size / tp_size`` slice of the MLP and a ``ceil(vocab / tp_size)`` slice of the
embedding and lm_head. Two all-reduces per layer (after o_proj and down_proj), one after the
embedding, one gather of the logits onto rank 0. ``check_tensor_parallel`` says which tp sizes fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tallyserve.attention.backend import AttentionBackend, check_attention_inputs, get_kv_cache_shape
from tallyserve.attention.metadata import AttentionMetadata, OutputRows
from tallyserve.distributed import parallel_state
from tallyserve.models import cpu_layers
from tallyserve.kernels import fused_ops
from tallyserve.models.cpu_products import pack_cpu_weight, pack_sgemm_weight
from tallyserve.models.layers import (
    ColumnParallelLinear,
    GatedMLP,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    apply_rotary,
    fuse_projections,
    linear,
    vocab_shard,
)
from tallyserve.config.model import ModelConfig, check_tensor_parallel
from tallyserve.config.quantization import Fp8Config
from tallyserve.models.moe import FusedMoE
from tallyserve.quantization.fp8 import Fp8Weight

logger = logging.getLogger(__name__)


def num_local_kv_heads(config: ModelConfig, tp_size: int) -> int:
    """KV heads each rank caches (the KV cache's head dimension per rank)."""
    check_tensor_parallel(config, tp_size)
    return max(1, config.num_key_value_heads // tp_size)


@dataclass(frozen=True)
class TensorParallelShapes:
    """One rank's share of the model (all counts local to the rank)."""

    tp_size: int
    tp_rank: int
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads (1 when replicated)
    kv_head_start: int  # first global KV head this rank holds
    intermediate_size: int
    vocab: ShardSpec  # this rank's slice of the vocabulary (rows of embed_tokens / lm_head)
    vocab_per_partition: int  # local rows of embed_tokens / lm_head (>= vocab.size: zero padding)

    @classmethod
    def create(cls, config: ModelConfig, tp_size: int = 1, tp_rank: int = 0) -> "TensorParallelShapes":
        check_tensor_parallel(config, tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be an integer in [0, {tp_size}), got {tp_rank!r}")
        kv_heads = config.num_key_value_heads
        local_kv = max(1, kv_heads // tp_size)
        # replicated (kv_heads < tp_size): ranks r * kv_heads // tp_size share one KV head
        kv_start = tp_rank * local_kv if kv_heads >= tp_size else tp_rank * kv_heads // tp_size
        vocab, per_partition = vocab_shard(config.vocab_size, tp_size, tp_rank)
        return cls(tp_size, tp_rank, config.num_attention_heads // tp_size, local_kv, kv_start,
                   config.intermediate_size // tp_size, vocab, per_partition)


def _projection_biases(config: ModelConfig) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj) as the Hugging Face classes build them."""
    if config.model_type == "qwen2":
        return config.attention_bias, False
    if config.model_type in ("mistral", "mixtral"):
        return False, False
    return config.attention_bias, config.attention_bias  # llama, qwen3


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: q/k/v column-parallel, o_proj row-parallel."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp: TensorParallelShapes,
                 quant: Optional[Fp8Config] = None, prefix: str = "") -> None:
        super().__init__()
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})"
            )
        self.num_heads = tp.num_heads
        self.num_kv_heads = tp.num_kv_heads
        self.head_dim = d = config.head_dim
        self.scale = self.head_dim ** -0.5
        self.attn_backend = attn_backend
        qkv_bias, o_bias = _projection_biases(config)
        hidden, q_size, kv_size = config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d
        kw = dict(tp_size=tp.tp_size, tp_rank=tp.tp_rank, quant=quant)
        kv_shard = ShardSpec(0, tp.kv_head_start * d, tp.num_kv_heads * d, kv_size)
        self.q_proj = ColumnParallelLinear(hidden, q_size, bias=qkv_bias, prefix=f"{prefix}.q_proj", **kw)
        self.k_proj = ColumnParallelLinear(hidden, kv_size, bias=qkv_bias, shard=kv_shard, prefix=f"{prefix}.k_proj",
                                           **kw)
        self.v_proj = ColumnParallelLinear(hidden, kv_size, bias=qkv_bias, shard=kv_shard, prefix=f"{prefix}.v_proj",
                                           **kw)
        self.o_proj = RowParallelLinear(q_size, hidden, bias=o_bias, prefix=f"{prefix}.o_proj", **kw)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qkv_weight: torch.Tensor | Fp8Weight | None = None  # set by fuse(): [q; k; v] in one matrix
        self.qkv_bias: torch.Tensor | None = None
        self.act_dtype: torch.dtype | None = None  # set by set_matmul_dtype: q/k/v come back in the model's dtype
        # an FP8 KV cache's (k_scale, v_scale): 1.0 unless the checkpoint has them (models/fp8_loader.py)
        self.kv_scale: tuple[float, float] = (1.0, 1.0)

    @torch.no_grad()
    def fuse(self, dtype: Optional[torch.dtype] = None) -> None:
        """One q/k/v projection (in ``dtype``, default the weights' own); the three Linear weights become
        views of it (no extra memory)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fuse_projections(projs, dtype)
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([p.bias for p in projs])
            start = 0
            for p in projs:
                rows = p.weight.shape[0]
                p.bias.data = self.qkv_bias[start:start + rows]
                start += rows

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata,
        out_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        """The attention output of every row, or with ``out_rows`` of those rows only (every row's K/V is written)."""
        num_tokens = x.shape[0]
        if self.qkv_weight is not None:
            return self._forward_fused(x, rope, kv_cache, meta, out_rows)
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if out_rows is not None:
            out = self.attn_backend.forward_rows(q, k, v, kv_cache, meta, self.scale, out_rows, self.kv_scale)
            return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _forward_fused(self, x, rope, kv_cache, meta, out_rows: Optional[OutputRows] = None) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, out_dtype=self.act_dtype)
        cos, sin = rope
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        backend = self.attn_backend
        if backend.supports_external_kv_write and fused_ops.fuses_kv_write(qkv):
            # rotary (+ q/k norm) and the KV write in one kernel; the backend only attends
            check_attention_inputs(q, k, v, kv_cache, meta)
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            fused_ops.rotary_write_kv_(qkv.view(t, hq + 2 * hkv, d), hq, hkv, cos, sin, kv_cache, meta.slot_mapping,
                                       *norm, kv_scale=self.kv_scale)
            out = (backend.forward_cached(q, kv_cache, meta, self.scale, self.kv_scale) if out_rows is None else
                   backend.forward_cached(q[out_rows.rows], kv_cache, out_rows.meta, self.scale, self.kv_scale))
        else:
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)  # q and k side by side: one in-place kernel
            if self.qk_norm:
                fused_ops.qk_norm_rotary_(qk, self.q_norm.weight, self.k_norm.weight, hq, self.q_norm.eps, cos, sin)
            else:
                fused_ops.rotary_(qk, cos, sin)
            out = (backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scale) if out_rows is None else
                   backend.forward_rows(q, k, v, kv_cache, meta, self.scale, out_rows, self.kv_scale))
        t = out.shape[0]
        o = self.o_proj
        if self.act_dtype is not None and o.tp_size == 1 and o.bias is None:
            # dtype="bfloat16" on the CPU: the product stays in bfloat16 (its exact value) and the next fused
            # add + RMSNorm adds it to the float32 residual, one conversion fewer per layer
            return linear(out.reshape(t, hq * d), o.weight, out_dtype=o.weight.dtype)
        return o(out.reshape(t, hq * d))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp: TensorParallelShapes,
                 quant: Optional[Fp8Config] = None, layer_index: int = 0, expert_parallel: bool = False) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_index}"
        mlp_bias = bool(config.hf_config.get("mlp_bias", False)) if config.model_type == "llama" else False
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attn_backend, tp, quant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp: GatedMLP | FusedMoE
        if layer_index in config.moe_layers:  # Qwen3-MoE's sparse layers, every Mixtral layer
            self.mlp = FusedMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                config.num_experts_per_tok, config.norm_topk_prob, tp_size=tp.tp_size,
                                tp_rank=tp.tp_rank, expert_parallel=expert_parallel,
                                float_weights=config.model_type == "mixtral")
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=mlp_bias,
                                tp_size=tp.tp_size, tp_rank=tp.tp_rank, quant=quant, prefix=f"{prefix}.mlp")

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata,
        out_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        """Every row's output, or with ``out_rows`` those rows' only (the last layer of a step)."""
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, out_rows)
        x = (x if out_rows is None else x[out_rows.rows]) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp: TensorParallelShapes,
                 quant: Optional[Fp8Config] = None, expert_parallel: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_size=tp.tp_size, tp_rank=tp.tp_rank)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, tp, quant, i, expert_parallel)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.fused = False
        self.matmul_dtype: Optional[torch.dtype] = None  # set_matmul_dtype: the layer norms hand it to the matmuls

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        out_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        """Final-norm hidden states of every row, or with ``out_rows`` of those rows only: the last layer leaves
        the other rows out after writing their K/V."""
        # positions of a step are below its longest sequence (padding rows of a graph sit at 0)
        rope = self.rotary_emb(positions, max(attn_meta.max_seq_len - 1, 0))
        x = self.embed_tokens(input_ids)
        if self.fused:
            return self._forward_fused(x, rope, kv_caches, attn_meta, out_rows)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, kv_cache, attn_meta, out_rows if i == last else None)
        return self.norm(x)

    def _forward_fused(self, x, rope, kv_caches, attn_meta, out_rows: Optional[OutputRows] = None) -> torch.Tensor:
        """The same computation with the residual stream threaded through fused add + RMSNorm."""
        fast = cpu_layers.decode_layers(self, x, rope, kv_caches, attn_meta)  # CPU: the layers in one compiled call
        if fast is not None:
            return fast if out_rows is None else fast[out_rows.rows]
        residual, mm = x, self.matmul_dtype
        last = len(self.layers) - 1
        h = fused_ops.add_rms_norm(x, None, self.layers[0].input_layernorm.weight, self.layers[0].input_layernorm.eps,
                                   out_dtype=mm)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i:
                norm = layer.input_layernorm
                h = fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps, out_dtype=mm)
            if i == last and out_rows is not None:  # only the sampled rows go on past the attention
                h = layer.self_attn(h, rope, kv_cache, attn_meta, out_rows)
                residual = residual[out_rows.rows]
            else:
                h = layer.self_attn(h, rope, kv_cache, attn_meta)
            norm = layer.post_attention_layernorm
            h = fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps, out_dtype=mm)
            h = layer.mlp(h)
        return fused_ops.add_rms_norm(h.to(residual.dtype), residual, self.norm.weight, self.norm.eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache; rank ``tp_rank`` of
    ``tp_size`` under tensor parallelism (the defaults: the whole model in one process)."""

    supports_output_rows = True  # forward(..., out_rows): the last layer for the sampled rows only

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: Optional[Fp8Config] = None,
                 enable_expert_parallel: bool = False) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.attn_backend = attn_backend
        self.tp = TensorParallelShapes.create(config, tp_size, tp_rank)
        window = config.sliding_window
        if window is not None and window < config.max_position_embeddings:
            # the engine refuses such a config unless max_model_len <= window (executor/resolve.py)
            logger.warning("sliding_window=%s: every layer attends to its full context, which equals the windowed "
                           "model only for sequences up to %s tokens", window, window)
        self.model = LlamaModel(config, attn_backend, self.tp, quant_config, enable_expert_parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size=tp_size, tp_rank=tp_rank)
        self.tie_weights()

    @property
    def tp_size(self) -> int:
        return self.tp.tp_size

    @property
    def tp_rank(self) -> int:
        return self.tp.tp_rank

    @property
    def num_local_heads(self) -> int:
        """Query heads on this rank."""
        return self.tp.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads on this rank: the head dimension of this rank's KV cache."""
        return self.tp.num_kv_heads

    def weight_shards(self) -> dict[str, ShardSpec]:
        """Checkpoint name -> the slice this rank holds, for every split parameter (empty at
        tp_size 1; replicated parameters are absent)."""
        shards = {}
        for prefix, module in self.named_modules():
            specs = getattr(module, "shard_specs", None)
            for pname, spec in (specs() if specs is not None else {}).items():
                shards[f"{prefix}.{pname}" if prefix else pname] = spec
        return shards

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: not with mixture-of-experts layers, which read
        how many rows each expert got on the host (``FusedMoE.forward``)."""
        return not self.config.moe_layers

    def checkpoint_name(self, name: str) -> str:
        """The parameter name a checkpoint tensor loads into: Mixtral's ``block_sparse_moe`` is this model's ``mlp``."""
        return name.replace(".block_sparse_moe.", ".mlp.") if self.config.model_type == "mixtral" else name

    def tie_weights(self) -> None:
        """Share the input embedding with the output projection when the config asks for it.
        Call again after anything that may replace parameters (e.g. ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(2, num_blocks, block_size, num_local_kv_heads, head_dim): one layer's cache tensor on
        this rank (num_local_kv_heads == num_key_value_heads at tp_size 1)."""
        return get_kv_cache_shape(num_blocks, block_size, self.tp.num_kv_heads, self.config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        out_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) int64. Returns final-norm hidden states (T, hidden_size), or with
        ``out_rows`` those of its rows only (S, hidden_size)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be (T,); got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"expected {self.config.num_hidden_layers} kv caches (one per layer), got {len(kv_caches)}"
            )
        if self.tp.tp_size > 1:
            self._check_tp_group()
        return self.model(input_ids, positions, kv_caches, attn_meta, out_rows)

    def _check_tp_group(self) -> None:
        size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
        if (size, rank) != (self.tp.tp_size, self.tp.tp_rank):
            raise RuntimeError(
                f"this model is rank {self.tp.tp_rank} of tp_size {self.tp.tp_size}, but the tensor-parallel group "
                f"is rank {rank} of {size}; call tallyserve.distributed.init_tensor_parallel first"
            )

    def enable_fused_kernels(self) -> bool:
        """Switch to the fused path (fused_ops: CUDA, or CPU float32); False where it is not available."""
        weight = self.model.embed_tokens.weight
        if not fused_ops.available(weight.device, weight.dtype):
            return False
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()  # a GatedMLP's gate/up, or each expert's
        self.model.fused = True
        return True

    @torch.no_grad()
    def set_matmul_dtype(self, dtype: torch.dtype) -> None:
        """Store the projections (q/k/v, o, gate/up, down, lm_head) in ``dtype`` and run their matmuls in it,
        while everything else (embedding, norms, RoPE, attention, KV cache, residual stream) stays in the
        model's dtype: the CPU's ``dtype="bfloat16"``, bfloat16 matmuls (AMX where the CPU has it) in a float32
        model. Call after ``enable_fused_kernels``; a tied lm_head gets its own copy."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            dense = isinstance(mlp, GatedMLP)  # experts stay in the model's dtype
            fused = [attn] if attn.qkv_weight is not None else []
            fused += [mlp] if dense and mlp.gate_up_weight is not None else []
            for module in fused:
                module.fuse(dtype)
            projs = [attn.o_proj] + ([mlp.down_proj] if dense else [])
            projs += [] if attn.qkv_weight is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
            projs += [] if not dense or mlp.gate_up_weight is not None else [mlp.gate_proj, mlp.up_proj]
            for proj in projs:
                proj.weight.data = proj.weight.to(dtype)
        # its own parameter: a tied lm_head shares the embedding's, which stays in the model's dtype
        self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach().to(dtype), requires_grad=False)
        if self.model.embed_tokens.weight.device.type == "cpu" and dtype == torch.bfloat16:
            self.pack_cpu_weights()
        if self.model.fused and self.model.embed_tokens.weight.device.type == "cpu":
            # the norms hand the matmuls bfloat16 and the MLP stays in it; q/k/v return in the model's dtype
            self.model.matmul_dtype = dtype
            for layer in self.model.layers:
                layer.self_attn.act_dtype = self.model.embed_tokens.weight.dtype

    @torch.no_grad()
    def pack_cpu_weights(self, kernel: str = "onednn") -> int:
        """oneDNN's blocked copies of the projections' CPU weights (q/k/v, o, gate/up, down, lm_head), so their
        matmuls do not re-block them on every call (``cpu_products.pack_cpu_weight``): the bfloat16 projections of
        ``set_matmul_dtype``, and a float32 model's where oneDNN is the faster library; ``kernel="sgemm"``: a
        float32 model's on tallyserve's AVX2 kernel instead (``cpu_products.pack_sgemm_weight``). Returns how many were
        packed."""
        used = [self.lm_head.weight]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            used += [attn.qkv_weight] if attn.qkv_weight is not None else \
                [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            used += [attn.o_proj.weight]
            if isinstance(mlp, GatedMLP):
                used += [mlp.gate_up_weight] if mlp.gate_up_weight is not None else \
                    [mlp.gate_proj.weight, mlp.up_proj.weight]
                used += [mlp.down_proj.weight]
        if kernel not in ("onednn", "sgemm"):
            raise ValueError(f"kernel must be 'onednn' or 'sgemm', got {kernel!r}")
        pack = pack_cpu_weight if kernel == "onednn" else pack_sgemm_weight
        packed = sum(pack(w) for w in used if w.device.type == "cpu" and w.is_contiguous())
        if packed:
            self.cpu_products = kernel  # whose kernel multiplies (the thread governor's task pool follows "sgemm")
        return packed

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden (N, hidden_size) -> float32 logits (N, vocab_size). Under tensor parallelism
        every rank must call it (it gathers); rank 0 gets the full logits, the others None."""
        if self.tp.tp_size == 1:
            return self.lm_head(hidden).float()
        return self.lm_head.compute_logits(hidden)
