"""The mixture-of-experts MLP of Qwen3-MoE and Mixtral (``FusedMoE``, vLLM's name): a router picks ``top_k`` of
``num_experts`` SiLU-gated MLPs per token and sums their outputs weighted by the routing probabilities.

Routing follows transformers: softmax of the router logits in float32, the top-k, renormalised to sum to 1 when
the model says so (Mixtral always, Qwen3-MoE with ``norm_topk_prob``). Computation: the (token, expert) pairs are
sorted by expert, and each expert that got tokens runs once over exactly its rows (gate, up, SiLU-and-multiply,
down), its output scaled by the routing weight and added into the token's row; no expert computes a token it was
not routed.

Weights are stacked per layer: ``w1`` (gate) and ``w3`` (up) (experts, intermediate, hidden), ``w2`` (down)
(experts, hidden, intermediate), loaded from the checkpoint's per-expert tensors (Qwen3-MoE's
``experts.E.gate_proj / up_proj / down_proj``, Mixtral's ``experts.E.w1 / w3 / w2``). Parallelism:
  * tensor parallel (default): every rank holds every expert, a ``1 / tp_size`` slice of its intermediate size
    (w1 / w3 by rows, w2 by columns, as the dense MLP is split), and the partial outputs are summed by one
    all-reduce;
  * expert parallel (``enable_expert_parallel``): rank r holds experts [r E / N, (r + 1) E / N) whole; every rank
    routes every token (the hidden states are replicated), computes its own experts' rows, and one all-reduce
    combines them.
The router (``gate``) is replicated.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tallyserve.distributed import parallel_state
from tallyserve.kernels import fused_moe
from tallyserve.models.layers import ShardSpec, even_shard

_EXPERT_LEAF = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PARTS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def check_expert_parallel(num_experts: int, tp_size: int, enable_expert_parallel: bool, intermediate: int) -> None:
    """ValueError unless the experts can be split over ``tp_size`` ranks: whole experts per rank under expert
    parallelism, else an even slice of each expert's intermediate size."""
    if enable_expert_parallel and num_experts % tp_size:
        raise ValueError(f"enable_expert_parallel: {num_experts} experts are not divisible by "
                         f"tensor_parallel_size={tp_size}")
    if not enable_expert_parallel and intermediate % tp_size:
        raise ValueError(f"the experts' intermediate size ({intermediate}) is not divisible by "
                         f"tensor_parallel_size={tp_size}; split whole experts instead with enable_expert_parallel")


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, *, tp_size: int = 1, tp_rank: int = 0, expert_parallel: bool = False,
                 float_weights: bool = False) -> None:
        """``float_weights``: the routing weights multiply in float32 (Mixtral), else in the activations' dtype
        (Qwen3-MoE), as transformers does."""
        super().__init__()
        check_expert_parallel(num_experts, tp_size, expert_parallel, intermediate_size)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size, self.expert_parallel, self.float_weights = tp_size, expert_parallel, float_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if expert_parallel and tp_size > 1:
            self.experts = even_shard(num_experts, tp_size, tp_rank, dim=0)
            self.inter = ShardSpec(1, 0, intermediate_size, intermediate_size)
        else:
            self.experts = ShardSpec(0, 0, num_experts, num_experts)
            self.inter = even_shard(intermediate_size, tp_size, tp_rank, dim=1)
        e, i = self.experts.size, self.inter.size
        self.w1 = nn.Parameter(torch.empty(e, i, hidden_size), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(e, i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        self.w13: Optional[torch.Tensor] = None  # set by fuse(): [w1 | w3] per expert, w1 / w3 views of it
        self._pending: dict[str, int] = {}

    def shard_specs(self) -> dict[str, ShardSpec]:
        """How each stacked weight is split (for random weights; the checkpoint's per-expert tensors load through
        ``load_checkpoint_tensor``)."""
        if self.tp_size == 1:
            return {}
        if self.expert_parallel:
            return {"w1": self.experts, "w3": self.experts, "w2": self.experts}
        i = self.inter
        return {"w1": i, "w3": i, "w2": ShardSpec(2, i.start, i.size, i.full_size)}

    @torch.no_grad()
    def fuse(self, dtype: Optional[torch.dtype] = None) -> None:
        """One gate/up weight per expert, (experts, 2 x intermediate, hidden); w1 / w3 become views of it."""
        i = self.w1.shape[1]
        self.w13 = torch.cat([self.w1, self.w3], dim=1).to(dtype or self.w1.dtype)
        self.w1.data, self.w3.data = self.w13[:, :i], self.w13[:, i:]

    @torch.no_grad()
    def load_checkpoint_tensor(self, prefix: str, leaf: str, f, name: str, file: str) -> list[str]:
        """Checkpoint tensor ``<prefix>.<leaf>`` into this layer: the router, or one expert's gate / up / down
        weight (this rank's slice, or nothing for another rank's expert). Returns the parameters now complete."""
        if leaf == "gate.weight":
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(self.gate.weight.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                                 f"{tuple(self.gate.weight.shape)} ({file})")
            self.gate.weight.copy_(tensor)
            return [f"{prefix}.gate.weight"]
        m = _EXPERT_LEAF.fullmatch(leaf)
        if m is None:
            raise ValueError(f"{name}: not a tensor of a mixture-of-experts layer ({file})")
        if f.get_slice(name).get_dtype().startswith("F8"):
            raise ValueError(f"{name} is FP8: FP8 experts are not supported yet ({file})")
        expert, part = int(m.group(1)), _PARTS[m.group(2)]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{name}: expert {expert} of a layer with {self.num_experts} ({file})")
        if not self.experts.start <= expert < self.experts.start + self.experts.size:
            return []  # another rank's expert
        param = getattr(self, part)
        local = param[expert - self.experts.start]
        sl = f.get_slice(name)
        full = (self.inter.full_size, local.shape[1]) if part != "w2" else (local.shape[0], self.inter.full_size)
        if tuple(sl.get_shape()) != full:
            raise ValueError(f"{name}: checkpoint shape {tuple(sl.get_shape())} != model shape {full} ({file})")
        lo, hi = self.inter.start, self.inter.start + self.inter.size
        local.copy_(sl[lo:hi] if part != "w2" else sl[:, lo:hi])
        if not self._pending:
            self._pending = {"w1": self.experts.size, "w3": self.experts.size, "w2": self.experts.size}
        self._pending[part] -= 1
        return [f"{prefix}.{part}"] if self._pending[part] == 0 else []

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both (T, top_k): softmax in float32, top-k, renormalised if the model says so."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.w13 is not None and fused_moe.available(x):  # CUDA: two grouped GEMM launches, no host sync
            out = fused_moe.fused_moe(x, self.w13, self.w2, weights, ids, self.experts.start, self.num_experts)
            return parallel_state.all_reduce(out) if self.tp_size > 1 else out
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order]
        start = 0
        first, last = self.experts.start, self.experts.start + self.experts.size
        for expert, count in enumerate(counts):
            if count and first <= expert < last:
                rows = tokens[start:start + count]
                e = expert - first
                h = x[rows]
                if self.w13 is not None:
                    gate, up = F.linear(h, self.w13[e]).chunk(2, dim=-1)
                else:
                    gate, up = F.linear(h, self.w1[e]), F.linear(h, self.w3[e])
                y = F.linear(F.silu(gate) * up, self.w2[e])
                out.index_add_(0, rows, (y * pair_weights[start:start + count, None]).to(out.dtype))
            start += count
        return parallel_state.all_reduce(out) if self.tp_size > 1 else out
