"""Draft-model proposer: a smaller model of the same tokenizer proposes k tokens per step.

The draft keeps its own KV cache tensors over the SAME block ids as the target (so it needs no
block manager of its own): the scheduler reserves k lookahead slots for it. Per request it
remembers which positions hold valid draft KV; after verification, drafts that were accepted
stay valid, the rest are recomputed on the next proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from tallyserve.attention.backend import get_attn_backend
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.models.loader import load_model, resolve_model
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.runner.model_runner import apply_matmul_dtype
from tallyserve.runner.rejection_sampler import processed_probs
from tallyserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tallyserve.config.speculative import SpeculativeConfig
    from tallyserve.executor.resolve import ResolvedEngine


@dataclass
class DraftRequest:
    request_id: str
    token_ids: list[int]  # the request's whole sequence so far
    block_ids: tuple[int, ...]
    params: SamplingParams


@dataclass
class _State:
    valid: int  # leading positions whose draft KV matches the sequence
    drafted_from: int  # sequence length when drafts were last proposed
    drafts: list[int]


class DraftModelProposer:
    @classmethod
    def load(cls, cfg: "SpeculativeConfig", target: "ResolvedEngine", num_blocks: int) -> "DraftModelProposer":
        """The draft model of ``cfg`` on the target's device and dtypes, with a KV cache of ``num_blocks``."""
        args = target.args
        resolved = resolve_model(cfg.model, "auto")
        if resolved.model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocab_size ({resolved.model_config.vocab_size}) differs from the "
                f"target's ({target.model_config.vocab_size}); they must share a tokenizer"
            )
        model = load_model(resolved, "auto", target.dtype, target.device, args.seed, get_attn_backend("torch"))
        apply_matmul_dtype(model, args.dtype, target.device)  # the CPU's dtype="bfloat16": as the target's
        # its KV cache in the target's cache dtype (bfloat16 with the CPU's bf16 projections)
        return cls(model, num_blocks, args.block_size, target.device, target.kv_cache_dtype,
                   cfg.num_speculative_tokens, args.seed)

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 num_speculative_tokens: int, seed: int = 0) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        shape = model.get_kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.config.num_hidden_layers)]
        self._state: dict[str, _State] = {}
        self._generator = torch.Generator(device=device).manual_seed(seed + 1)

    def forget(self, request_id: str) -> None:
        """Preempted or finished: its blocks may change, so its draft KV is no longer trusted."""
        self._state.pop(request_id, None)

    def _valid_prefix(self, req: DraftRequest) -> int:
        st = self._state.get(req.request_id)
        if st is None:
            return 0
        valid = st.valid
        # Drafts fed to the model (all but the last) that turned out to be the real tokens.
        for j, d in enumerate(st.drafts[:-1]):
            pos = st.drafted_from + j
            if pos < len(req.token_ids) - 1 and req.token_ids[pos] == d:
                valid = pos + 1
            else:
                break
        return min(valid, len(req.token_ids) - 1)

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest], k: Optional[int] = None) -> dict[str, tuple[list[int], torch.Tensor]]:
        """Drafts (and their proposal distributions, (k, V)) for each request."""
        k = self.k if k is None else k
        if not reqs or k < 1:
            return {}
        starts = {r.request_id: self._valid_prefix(r) for r in reqs}
        feeds = {r.request_id: r.token_ids[starts[r.request_id]:] for r in reqs}
        drafts: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        for step in range(k):
            entries = []
            for r in reqs:
                rid = r.request_id
                pos = starts[rid] if step == 0 else len(r.token_ids) + step - 1
                toks = feeds[rid] if step == 0 else [drafts[rid][-1]]
                entries.append(ScheduledRequest(rid, tuple(toks), pos, r.block_ids, True, r.params, 0))
            so = SchedulerOutput(0, tuple(entries), sum(len(e.token_ids) for e in entries))
            batch = ForwardBatch.build(so, self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            for i, r in enumerate(reqs):
                token, p = self._draw(logits[i : i + 1], r.params)
                drafts[r.request_id].append(token)
                probs[r.request_id].append(p)
        for r in reqs:
            n = len(r.token_ids)
            self._state[r.request_id] = _State(valid=n, drafted_from=n, drafts=drafts[r.request_id])
        return {rid: (drafts[rid], torch.cat(probs[rid])) for rid in drafts}

    def _draw(self, logits: torch.Tensor, params: SamplingParams) -> tuple[int, torch.Tensor]:
        if params.is_greedy:
            token = int(logits.argmax(dim=-1))
            p = torch.zeros_like(logits, dtype=torch.float32)
            p[0, token] = 1.0
            return token, p
        p = processed_probs(logits, params)
        return int(torch.multinomial(p[0], 1, generator=self._generator)), p
