"""Test helpers: tiny random Hugging Face checkpoints, and a paged-KV harness that drives a
tallyserve model step by step with hand-built AttentionMetadata.

Import from a test with ``from tests.tiny_models import make_tiny_model, load_hf_model, PagedKV``.
"""

from __future__ import annotations

import random

import torch

from tallyserve.attention.metadata import AttentionMetadata

# The builders live in the package (the benchmarks use them too); re-exported here for the tests.
from tallyserve.bench.tiny_models import ARCHS, MOE_ARCHS, _hf_config, _randomize, make_tiny_model  # noqa: E402,F401


def load_hf_model(model_dir: str) -> torch.nn.Module:
    """The reference transformers model of a directory made by ``make_tiny_model`` (eager, float32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], eos: tuple[int, ...], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, cut after the first EOS (as the engine's output ends)."""
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=list(eos), pad_token_id=eos[0])
        toks = out[0, len(p):].tolist()
        refs.append(toks[: toks.index(eos[0]) + 1] if eos[0] in toks else toks)
    return refs


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
