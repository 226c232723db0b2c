"""A model-free runner for scheduler tests: the KV cache holds token ids instead of tensors.

It executes a SchedulerOutput the way the real runner does (partial-reuse copies, then writes at
the slot mapping built by the real ForwardBatch builder, placeholder rows of an async-scheduled
step filled from the previous step's tokens) and, for every row, checks that the request's whole
context is present in its blocks. The next token is a pure function of the
context, so any cache mix-up changes the output and the reference comparison catches it.
"""

from __future__ import annotations

import numpy as np
import torch

from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.runner.forward_batch import ForwardBatch

VOCAB = 97


def next_token(context: list[int]) -> int:
    h = len(context)
    for t in context[-4:]:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(ctx)
        ctx.append(t)
        out.append(t)
        if eos is not None and t == eos:
            break
    return out


def verify_greedy(context: list[int], drafts) -> list[int]:
    """Accepted drafts plus one token: exactly what plain greedy decoding would produce."""
    ctx, out = list(context), []
    for d in drafts:
        t = next_token(ctx)
        out.append(t)
        ctx.append(t)
        if t != d:
            return out
    out.append(next_token(ctx))
    return out


class OracleRunner:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.cache = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.host = np.full(max(num_host_blocks, 1) * block_size, -1, dtype=np.int64)
        self.steps = 0
        self.last_tokens = np.zeros(0, dtype=np.int64)  # the previous step's sampled tokens
        self.last_index: dict[str, int] = {}  # request id -> its row of last_tokens

    def execute(self, so: SchedulerOutput, contexts: dict[str, list[int]]) -> tuple[ForwardBatch, dict[str, list[int]]]:
        """Run one step. `contexts` maps request id -> all its tokens (for checking only)."""
        bs, moves = self.block_size, so.kv_transfers
        for c in moves.offloads:
            self.host[c.dst * bs: (c.dst + 1) * bs] = self.cache[c.src * bs: (c.src + 1) * bs]
        for c in moves.restores:
            self.cache[c.dst * bs: (c.dst + 1) * bs] = self.host[c.src * bs: (c.src + 1) * bs]
        for c in moves.copies:
            self.cache[c.dst * bs: c.dst * bs + c.num_tokens] = self.cache[c.src * bs: c.src * bs + c.num_tokens]
        batch = ForwardBatch.build(so, bs, torch.device("cpu"), self.last_index)
        ids = batch.input_ids.numpy().copy()
        if batch.fill_rows is not None:
            ids[batch.fill_rows.numpy()] = self.last_tokens[batch.fill_src.numpy()]
        self.cache[batch.attn_meta.slot_mapping.numpy()] = ids
        sampled = {}
        for entry in so.requests:
            end = entry.start_position + entry.num_tokens - entry.num_draft_tokens
            slots = [entry.block_ids[p // bs] * bs + p % bs for p in range(end)]
            seen = self.cache[slots].tolist()
            expected = list(contexts[entry.request_id][:end])
            if expected and expected[-1] < 0:  # the placeholder of the previous step's token
                expected[-1] = int(self.last_tokens[self.last_index[entry.request_id]])
            if seen != expected:
                raise AssertionError(f"{entry.request_id}: KV holds {seen}, context is {expected}")
            if entry.sample:
                sampled[entry.request_id] = verify_greedy(seen, entry.draft_token_ids)
        self.steps += 1
        self.last_index = {rid: i for i, rid in enumerate(sampled)}
        self.last_tokens = np.array([toks[-1] for toks in sampled.values()], dtype=np.int64)
        return batch, sampled


def draw_requests(draw, max_len: int, max_new: int, arrivals) -> list[tuple]:
    """Hypothesis: 1-12 requests sharing prefixes of one random token run, each
    (request id, prompt, max_tokens, arrival step, abort step or None, priority)."""
    from hypothesis import strategies as st

    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=max_len - 2))
    reqs = []
    for i in range(draw(st.integers(1, 12))):
        share = draw(st.integers(0, len(shared)))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max(1, max_len - share - 1)))
        prompt = (shared[:share] + tail)[: max_len - 1]
        max_tokens = draw(st.integers(1, max(1, min(max_new, max_len - len(prompt)))))
        arrive = draw(arrivals)
        abort_at = draw(st.one_of(st.none(), st.integers(0, 30)))
        reqs.append((f"r{i}", prompt, max_tokens, arrive, abort_at, draw(st.integers(0, 2))))
    return reqs
