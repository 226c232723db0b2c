"""Decoder-only Llama-family model over a paged KV cache: Llama, Mistral, Qwen2, Qwen3.

The four differ only in configuration, read from ``ModelConfig``:
  * Qwen2: biases on the q/k/v projections (not on o_proj);
  * Qwen3: per-head RMSNorm of q and k before RoPE, explicit head_dim;
  * Llama: optional bias on all four attention projections (``attention_bias``) and MLP;
  * tied or untied input/output embeddings.
Parameter names match Hugging Face checkpoints, so a safetensors state dict loads by name.

The model is flat-token: ``forward`` takes T token ids with explicit positions (requests laid out
one after another, as ``AttentionMetadata`` describes) and returns T hidden states.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tallyserve.attention.backend import AttentionBackend, get_kv_cache_shape
from tallyserve.attention.metadata import AttentionMetadata
from tallyserve.models import fused_ops
from tallyserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from tallyserve.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


def _projection_biases(config: ModelConfig) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj) as the Hugging Face classes build them."""
    if config.model_type == "qwen2":
        return config.attention_bias, False
    if config.model_type == "mistral":
        return False, False
    return config.attention_bias, config.attention_bias  # llama, qwen3


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self.scale = self.head_dim ** -0.5
        self.attn_backend = attn_backend
        qkv_bias, o_bias = _projection_biases(config)
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None  # set by fuse(): [q; k; v] in one matrix
        self.qkv_bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """One q/k/v projection; the three Linear weights become views of it (no extra memory)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projs])
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([p.bias for p in projs])
        start = 0
        for p in projs:
            rows = p.weight.shape[0]
            p.weight.data = self.qkv_weight[start:start + rows]
            if self.qkv_bias is not None:
                p.bias.data = self.qkv_bias[start:start + rows]
            start += rows

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_weight is not None:
            return self._forward_fused(x, rope, kv_cache, meta)
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _forward_fused(self, x, rope, kv_cache, meta) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        cos, sin = rope
        if self.qk_norm:
            q = self.q_norm(qkv[:, : hq * d].reshape(t, hq, d))
            k = self.k_norm(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d))
            fused_ops.rotary_(q, cos, sin)
            fused_ops.rotary_(k, cos, sin)
        else:  # q and k sit side by side in qkv: one in-place rotation for both
            fused_ops.rotary_(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, hq * d))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        mlp_bias = bool(config.hf_config.get("mlp_bias", False)) if config.model_type == "llama" else False
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=mlp_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attn_backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.fused = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        rope = self.rotary_emb(positions)
        x = self.embed_tokens(input_ids)
        if self.fused:
            return self._forward_fused(x, rope, kv_caches, attn_meta)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, attn_meta)
        return self.norm(x)

    def _forward_fused(self, x, rope, kv_caches, attn_meta) -> torch.Tensor:
        """The same computation with the residual stream threaded through fused add + RMSNorm."""
        residual = x
        h = fused_ops.add_rms_norm(x, None, self.layers[0].input_layernorm.weight, self.layers[0].input_layernorm.eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i:
                norm = layer.input_layernorm
                h = fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps)
            h = layer.self_attn(h, rope, kv_cache, attn_meta)
            norm = layer.post_attention_layernorm
            h = fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps)
            h = layer.mlp(h)
        return fused_ops.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        window = config.hf_config.get("sliding_window")
        if config.hf_config.get("use_sliding_window", True) and window and window < config.max_position_embeddings:
            logger.warning("sliding_window=%s is ignored: every layer attends to its full context", window)
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the input embedding with the output projection when the config asks for it.
        Call again after anything that may replace parameters (e.g. ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(2, num_blocks, block_size, num_kv_heads, head_dim): one layer's cache tensor."""
        return get_kv_cache_shape(num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) int64. Returns final-norm hidden states (T, hidden_size)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be (T,); got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"expected {self.config.num_hidden_layers} kv caches (one per layer), got {len(kv_caches)}"
            )
        return self.model(input_ids, positions, kv_caches, attn_meta)

    def enable_fused_kernels(self) -> bool:
        """Switch to the fused GPU path (fused_ops); False where it is not available."""
        device = self.model.embed_tokens.weight.device
        if not fused_ops.available(device):
            return False
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.model.fused = True
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden_size) -> float32 logits (N, vocab_size)."""
        return self.lm_head(hidden).float()
