"""Test helpers: tiny random Hugging Face checkpoints, and a paged-KV harness that drives a
tallyserve model step by step with hand-built AttentionMetadata.

Import from a test with ``from tests.tiny_models import make_tiny_model, load_hf_model, PagedKV``.
"""

from __future__ import annotations

import math
import os
import random
from typing import Optional

import torch

from tallyserve.attention.metadata import AttentionMetadata

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _hf_config(arch: str, vocab_size: int, tie: bool, rope_scaling: Optional[dict], overrides: dict):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {list(classes)}, got {arch!r}")
    kwargs = dict(_TINY_SHAPE, vocab_size=vocab_size, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # explicit head_dim != hidden / heads, as in real Qwen3
    theta = float(overrides.pop("rope_theta", 10000.0))
    # transformers 5 keeps RoPE settings in one nested dict, `rope_parameters`.
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    kwargs.update(overrides)
    return classes[arch](**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are far from uniform; norms and biases perturbed."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        elif "embed_tokens" in name:
            param.copy_(torch.randn(param.shape, generator=gen))
        else:
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))


def make_tiny_model(
    tmp_dir,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: Optional[dict] = None,
    seed: int = 0,
    vocab_size: int = 256,
    max_shard_size: Optional[str | int] = None,
    **overrides,
) -> str:
    """Save a random float32 ``transformers`` model of ``arch`` into ``tmp_dir`` (safetensors,
    sharded when ``max_shard_size`` is given, e.g. "100KB") and return the directory.

    ``rope_scaling`` is e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}; ``overrides`` go to the
    config (``rope_theta`` included). No tokenizer files are written."""
    import transformers

    config = _hf_config(arch, vocab_size, tie_word_embeddings, rope_scaling, dict(overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    out = os.fspath(tmp_dir)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


def load_hf_model(model_dir: str) -> torch.nn.Module:
    """The reference transformers model of a directory made by ``make_tiny_model`` (eager, float32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


class PagedKV:
    """Drives a tallyserve model through steps with a paged KV cache whose block ids are handed out
    in shuffled order (so a request's blocks are non-contiguous). Each step feeds some requests
    their next tokens; metadata is built by hand exactly as AttentionMetadata documents.

    The caches start filled with NaN, so a read of a slot never written shows up in the outputs."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4, seed: int = 0, dtype=torch.float32):
        self.model = model
        self.block_size = block_size
        shape = model.get_kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(model.config.num_hidden_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def _slot(self, req: str, pos: int) -> int:
        table = self.block_tables[req]
        while len(table) <= pos // self.block_size:
            table.append(self.free_blocks.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def build(self, batch: list[tuple[str, list[int]]], num_padding: int = 0):
        """(input_ids, positions, AttentionMetadata) for one step; advances num_computed."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for req, tokens in batch:
            self.block_tables.setdefault(req, [])
            start = self.num_computed.get(req, 0)
            for i, tok in enumerate(tokens):
                ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(req, start + i))
            self.num_computed[req] = start + len(tokens)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
        ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        width = max(len(self.block_tables[req]) for req, _ in batch)
        tables = [self.block_tables[req] + [0] * (width - len(self.block_tables[req])) for req, _ in batch]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_start_loc_cpu=tuple(starts),
            seq_lens_cpu=tuple(seq_lens),
            block_size=self.block_size,
            max_query_len=max(len(t) for _, t in batch),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta

    @torch.no_grad()
    def step(self, batch: list[tuple[str, list[int]]], num_padding: int = 0) -> dict[str, torch.Tensor]:
        """Run one forward; return each request's logits rows (float32, (len(tokens), vocab))."""
        ids, positions, meta = self.build(batch, num_padding)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        out, row = {}, 0
        for req, tokens in batch:
            out[req] = logits[row:row + len(tokens)]
            row += len(tokens)
        return out
