"""Step time of a forward pass: a roofline of the model's shape on named hardware, or a
measured profile (`tallyserve profile`) interpolated over (batch size, new tokens, context).

Inputs are the numbers the ledger charged for the step (`StepShape`), nothing else.

Tensor parallelism (`tensor_parallel_size` N, the roofline only): every rank runs its shard at
the same time, so a step costs one rank's compute and memory traffic plus the collectives, which
nothing overlaps. A rank's shard follows tallyserve/models (Megatron): q/k/v and gate/up
column-parallel, o_proj and down_proj row-parallel, embed_tokens and lm_head vocab-parallel
(ceil(vocab / N) rows each), so its matmul FLOPs and weight bytes are 1/N of the model's; its
query heads are 1/N (attention FLOPs / N) and its KV heads num_kv_heads / N, or one replicated
head when num_kv_heads < N (`kv_bytes_per_token`, shared with the runner). Communication per
step, as the model issues it: one all-reduce after the vocab-parallel embedding and two per layer
(after o_proj and down_proj), each of num_tokens x hidden x 2 bytes (bf16), priced as a ring,
2 (N - 1) / N x bytes / link_bandwidth + collective_latency_s; and one gather of the sampled
rows' logits onto rank 0 (num_sampled x padded vocab x 2 bytes, bf16 before the float32 cast),
(N - 1) / N x bytes / link_bandwidth + collective_latency_s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

from tallyserve.attention.metadata import CASCADE_MIN_REQS, cascade_prefix_len
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.config.model import ModelConfig, kv_bytes_per_token
from tallyserve.runner.forward_batch import block_table
from tallyserve.config.model import check_tensor_parallel

BF16_BYTES = 2


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    matmul_flops: float  # achieved dense bf16 FLOP/s
    mem_bandwidth: float  # achieved device-memory bytes/s
    mem_bytes: float  # device memory
    step_overhead_s: float = 1.0e-3  # launch / host work per step (CUDA graphs make it small)
    per_request_overhead_s: float = 1.0e-5  # per row of the batch (metadata, sampling)
    host_bandwidth: float = 50e9  # device <-> host copies (PCIe Gen5 x16, achieved)
    # Tensor-parallel collectives between GPUs of one host: the bus bandwidth a ring all-reduce
    # reaches (nccl-tests' busbw; 2 (N - 1) / N x bytes / link_bandwidth) and a fixed cost per
    # collective (launch + NCCL's small-message latency). Defaults: H200 over NVLink 4 / NVSwitch.
    # NVLink 4 is 18 links x 25 GB/s = 450 GB/s per direction per GPU (NVIDIA's H200 SXM datasheet:
    # 900 GB/s bidirectional). NCCL's ring algorithm reaches about 80% of that: nccl-tests
    # all_reduce_perf reports a large-message busbw of about 360-370 GB/s on 8x H100/H200 SXM with
    # NVLink SHARP (NVLS) off, as on this project's machines (NCCL_NVLS_ENABLE=0; with NVLS about
    # 460-480 GB/s, above the ring's ceiling). Small all-reduces (decode: 16 KB per token at
    # hidden 8192) take about 10-20 us over NVLink, latency-bound; 15 us is the middle of that range.
    # Published figures, not measured here. Override with a hardware JSON ({"link_bandwidth": ...,
    # "collective_latency_s": ...}) or `simulate --link-bandwidth-gbs / --collective-latency-us`.
    link_bandwidth: float = 360e9
    collective_latency_s: float = 15e-6
    # dense FP8 FLOP/s of the tensor cores (quantization="fp8" projections); 0: twice matmul_flops, the ratio of
    # Hopper's FP8 and bf16 dense rates in NVIDIA's datasheets (1979 / 989 TFLOP/s on an H100 SXM)
    fp8_matmul_flops: float = 0.0

    @property
    def fp8_flops(self) -> float:
        return self.fp8_matmul_flops or 2.0 * self.matmul_flops


# Measured on the H200 machines (docs/benchmarks.md): ~700 TFLOP/s bf16 matmul, ~4.27 TB/s copy, 141 GB.
# NVLink figures: published (see HardwareSpec.link_bandwidth), not measured here.
# H100: ~798 TFLOP/s bf16 and ~3.0 TB/s copy measured on this workplace's H100 machines (device KINDS.md), 80 GB.
HARDWARE = {"h200": HardwareSpec("h200", 700e12, 4.27e12, 141e9, link_bandwidth=360e9, collective_latency_s=15e-6),
            "h100": HardwareSpec("h100", 700e12, 3.0e12, 80e9, link_bandwidth=360e9, collective_latency_s=15e-6)}


@dataclass(frozen=True)
class StepShape:
    num_tokens: int  # query tokens computed (what the ledger charged)
    num_requests: int
    num_decode_rows: int  # requests computing exactly one token
    num_sampled: int  # rows that produce logits
    context_tokens: int  # sum over requests of the KV length attended (start + new)
    attn_pairs: int  # causal query-key pairs: sum of n * start + n * (n + 1) / 2
    host_transfer_tokens: int = 0  # KV slots offloaded to / restored from the host tier
    copy_tokens: int = 0  # KV slots copied device to device (partial-block reuse)
    # cascade attention: KV tokens at the start of every request's context read once for all of them
    shared_prefix_tokens: int = 0
    max_seq_len: int = 0  # the longest request's KV length (start + new); 0: unknown

    @property
    def seq_len_spread(self) -> float:
        """The longest request's KV length minus the mean (0 when unknown): how far the longest decode
        programs of the step run past the average (see ``ProfileCostModel``'s decode spread)."""
        if not self.max_seq_len or not self.num_requests:
            return 0.0
        return max(0.0, self.max_seq_len - self.context_tokens / self.num_requests)

    @property
    def kv_read_tokens(self) -> int:
        """KV tokens attention reads: each request's context, the shared prefix only once."""
        return self.context_tokens - max(self.num_requests - 1, 0) * self.shared_prefix_tokens

    @property
    def cached_len(self) -> float:
        """Mean KV tokens per request already in the cache before the step (the shared prefix of
        cascade attention counted once): a profile's ``context_len`` coordinate. The step's own new
        tokens are not part of it: a grid step of ``context_len`` c maps back to c."""
        return (self.kv_read_tokens - self.num_tokens) / max(self.num_requests, 1)

    @property
    def extra_attn_pairs(self) -> int:
        """Causal query-key pairs beyond those of one query token per request: the attention of the
        prefill chunks (a row of n tokens from position s has n s + n (n + 1) / 2 pairs; one decode
        token has s + 1, which this leaves out)."""
        return self.attn_pairs - (self.context_tokens - self.num_tokens) - self.num_requests

    @classmethod
    def of(cls, so: SchedulerOutput, block_size: int = 0, cascade: bool = False) -> "StepShape":
        """``cascade``: the engine attends a prefix every decode row shares once (as the GPU engine
        does unless ``disable_cascade_attn``); the step's block tables tell how long it is."""
        tokens = decode = sampled = ctx = pairs = longest = 0
        for e in so.requests:
            n, s = len(e.token_ids), e.start_position
            tokens += n
            ctx += s + n
            longest = max(longest, s + n)
            pairs += n * s + n * (n + 1) // 2
            decode += n == 1
            sampled += e.sample
        moves = so.kv_transfers
        host = sum(c.num_tokens for c in moves.offloads) + sum(c.num_tokens for c in moves.restores) if moves else 0
        copies = sum(c.num_tokens for c in moves.copies) if moves else 0
        shared = _shared_prefix(so, block_size) if cascade and block_size and decode == len(so.requests) else 0
        return cls(tokens, len(so.requests), decode, sampled, ctx, pairs, host, copies, shared, longest)


def _shared_prefix(so: SchedulerOutput, block_size: int) -> int:
    """The prefix the engine's batch builder would name for cascade attention (``cascade_prefix_len``)."""
    reqs = so.requests
    if len(reqs) < CASCADE_MIN_REQS:
        return 0
    table = block_table(reqs)
    seq_lens = np.fromiter((e.start_position + len(e.token_ids) for e in reqs), dtype=np.int64, count=len(reqs))
    query_lens = np.fromiter((len(e.token_ids) for e in reqs), dtype=np.int64, count=len(reqs))
    return cascade_prefix_len(table, seq_lens, query_lens, block_size)


@dataclass(frozen=True)
class ModelShape:
    """FLOP and byte counts of a decoder-only transformer, from its config: those of one
    tensor-parallel rank (its shard of the weights, its heads) when tensor_parallel_size > 1."""

    linear_params: int  # q, k, v, o and MLP weights of all layers
    lm_head_params: int
    embed_params: int
    attn_flops_per_pair: int  # QK^T and PV, all layers and heads
    kv_bytes_per_token: int  # K and V of all layers, in the cache's dtype (bf16, or FP8: one byte)
    tensor_parallel_size: int = 1
    hidden_size: int = 0
    num_layers: int = 0
    padded_vocab: int = 0  # vocab rows over all ranks: ceil(vocab / N) x N
    linear_bytes_per_param: int = BF16_BYTES  # 1 with FP8 projections (embeddings and lm_head stay bf16)
    # mixture of experts (one rank's share): sparse layers, experts held, one expert's gate/up/down params, experts
    # per token, experts per layer; ``linear_params`` counts every expert held, ``active_params`` what one token
    # computes on average on this rank (its top_k experts, times the share of experts this rank holds)
    num_moe_layers: int = 0
    experts_per_rank: int = 0
    expert_params: int = 0
    top_k: int = 0
    num_experts: int = 0
    active_params: int = 0

    @classmethod
    def of(cls, mc: ModelConfig, tensor_parallel_size: int = 1, fp8_weights: bool = False,
           fp8_kv_cache: bool = False, expert_parallel: bool = False) -> "ModelShape":
        """ValueError (check_tensor_parallel's) when the model cannot be split over the ranks. ``fp8_weights``:
        the projections in FP8 (quantization="fp8" or an FP8 checkpoint); ``fp8_kv_cache``: kv_cache_dtype="fp8";
        ``expert_parallel``: a mixture of experts' experts placed whole on the ranks (else each split)."""
        tp = tensor_parallel_size
        check_tensor_parallel(mc, tp)
        h, q, kv, d = mc.hidden_size, mc.num_attention_heads // tp, mc.num_key_value_heads, mc.head_dim
        kv = max(kv // tp, 1)  # one replicated KV head per rank when num_kv_heads < N
        attn = h * q * d + 2 * h * kv * d + q * d * h
        moe_layers = len(mc.moe_layers)
        dense = mc.num_hidden_layers * attn + (mc.num_hidden_layers - moe_layers) * 3 * h * (mc.intermediate_size // tp)
        experts = held = per_expert = 0
        if moe_layers:
            experts = mc.num_experts
            held = experts // tp if expert_parallel else experts
            per_expert = 3 * h * (mc.moe_intermediate_size if expert_parallel else mc.moe_intermediate_size // tp)
            dense += moe_layers * h * experts  # the router, replicated
        rows = -(-mc.vocab_size // tp)  # vocab_shard: ceil(vocab / N) rows per rank, zero-padded
        vocab = rows * h
        active = dense + (moe_layers * mc.num_experts_per_tok * per_expert * held // experts if experts else 0)
        return cls(
            linear_params=dense + moe_layers * held * per_expert,
            num_moe_layers=moe_layers, experts_per_rank=held, expert_params=per_expert,
            top_k=mc.num_experts_per_tok if experts else 0, num_experts=experts, active_params=active,
            lm_head_params=vocab,
            embed_params=0 if mc.tie_word_embeddings else vocab,
            attn_flops_per_pair=4 * mc.num_hidden_layers * q * d,
            kv_bytes_per_token=kv_bytes_per_token(mc, 1 if fp8_kv_cache else BF16_BYTES, tp),
            tensor_parallel_size=tp,
            hidden_size=h,
            num_layers=mc.num_hidden_layers,
            padded_vocab=rows * tp,
            linear_bytes_per_param=1 if fp8_weights else BF16_BYTES,
        )

    @property
    def fp8_weights(self) -> bool:
        return self.linear_bytes_per_param == 1

    def computed_params(self) -> int:
        """Projection parameters one token multiplies (on this rank, on average): all of a dense model's."""
        return self.active_params or self.linear_params

    def read_params(self, num_tokens: int) -> int:
        """Projection parameters a step of ``num_tokens`` tokens reads: every dense one, and of each sparse layer
        the experts its tokens reach (with uniform routing, experts_per_rank x (1 - (1 - top_k / E) ^ tokens))."""
        if not self.num_moe_layers:
            return self.linear_params
        experts = self.num_moe_layers * self.experts_per_rank * self.expert_params
        reached = 1.0 - (1.0 - self.top_k / self.num_experts) ** max(num_tokens, 0)
        return int(self.linear_params - experts + experts * reached)

    @property
    def weight_bytes(self) -> int:
        """The weights (of one rank under tensor parallelism): projections in bf16 or FP8, embeddings and lm_head in
        bf16 (the FP8 scales, one float32 per output row or 128 x 128 block, are left out: under 0.5%)."""
        return self.linear_bytes_per_param * self.linear_params + BF16_BYTES * (self.lm_head_params + self.embed_params)

    @property
    def num_all_reduces(self) -> int:
        """Per forward pass: after the vocab-parallel embedding, and after o_proj and down_proj."""
        return 2 * self.num_layers + 1 if self.tensor_parallel_size > 1 else 0


def all_reduce_time(nbytes: float, tp: int, link_bandwidth: float, latency_s: float) -> float:
    """A ring all-reduce of `nbytes` over `tp` ranks: 2 (N - 1) / N x bytes / bandwidth + latency."""
    if tp <= 1:
        return 0.0
    return 2.0 * (tp - 1) / tp * nbytes / link_bandwidth + latency_s


def gather_time(total_bytes: float, tp: int, link_bandwidth: float, latency_s: float) -> float:
    """A (all-)gather of `total_bytes` (all ranks' parts together): (N - 1) / N x bytes / bandwidth + latency."""
    if tp <= 1:
        return 0.0
    return (tp - 1) / tp * total_bytes / link_bandwidth + latency_s


class RooflineCostModel:
    """max(compute, memory) for the linear layers and for attention (one rank's share under
    tensor parallelism), plus the collectives and per-step overheads.

    `busy_s` and `comm_s` add up every step priced (the simulator prices each step once), so
    comm_s / busy_s is the share of the virtual time spent in communication."""

    def __init__(self, model_config: ModelConfig, hw: HardwareSpec, tensor_parallel_size: int = 1,
                 fp8_weights: bool = False, fp8_kv_cache: bool = False, expert_parallel: bool = False) -> None:
        self.hw = hw
        self.shape = ModelShape.of(model_config, tensor_parallel_size, fp8_weights, fp8_kv_cache, expert_parallel)
        self.tensor_parallel_size = tensor_parallel_size
        self.mem_bytes = hw.mem_bytes  # of one GPU (one rank)
        self.name = (f"roofline:{hw.name}" + (f"x{tensor_parallel_size}" if tensor_parallel_size > 1 else "")
                     + ("+ep" if expert_parallel and tensor_parallel_size > 1 else "")
                     + ("+fp8" if fp8_weights else "") + ("+fp8kv" if fp8_kv_cache else ""))
        self.busy_s = 0.0
        self.comm_s = 0.0

    def comm_time(self, s: StepShape) -> float:
        """The step's collectives: the all-reduces of the hidden states and the logits gather."""
        hw, m = self.hw, self.shape
        tp = m.tensor_parallel_size
        if tp <= 1:
            return 0.0
        hidden_bytes = float(s.num_tokens) * m.hidden_size * BF16_BYTES
        t = m.num_all_reduces * all_reduce_time(hidden_bytes, tp, hw.link_bandwidth, hw.collective_latency_s)
        if s.num_sampled:
            logits_bytes = float(s.num_sampled) * m.padded_vocab * BF16_BYTES
            t += gather_time(logits_bytes, tp, hw.link_bandwidth, hw.collective_latency_s)
        return t

    def step_time(self, s: StepShape, overlapped: Optional[bool] = None) -> float:
        """``overlapped`` (launched while another step runs) changes nothing: the roofline prices
        the device's work, and its per-step overhead stands for the host's."""
        hw, m = self.hw, self.shape
        # the projections at the FP8 tensor-core rate with FP8 weights, lm_head in bf16
        # a mixture of experts computes each token's top-k experts and reads the experts its tokens reach
        proj_rate = hw.fp8_flops if m.fp8_weights else hw.matmul_flops
        t_flops = (2.0 * m.computed_params() * s.num_tokens / proj_rate
                   + 2.0 * m.lm_head_params * s.num_sampled / hw.matmul_flops)
        lin_bytes = (m.linear_bytes_per_param * m.read_params(s.num_tokens)
                     + (BF16_BYTES * m.lm_head_params if s.num_sampled else 0))
        t_lin = max(t_flops, lin_bytes / hw.mem_bandwidth)
        attn_flops = float(m.attn_flops_per_pair) * s.attn_pairs
        kv_bytes = float(m.kv_bytes_per_token) * (s.kv_read_tokens + s.num_tokens)  # read all, write new
        t_attn = max(attn_flops / hw.matmul_flops, kv_bytes / hw.mem_bandwidth)
        t_comm = self.comm_time(s)
        t = (t_lin + t_attn + t_comm + transfer_time(m, hw.host_bandwidth, hw.mem_bandwidth, s)
             + hw.step_overhead_s + hw.per_request_overhead_s * s.num_requests)
        self.busy_s += t
        self.comm_s += t_comm
        return t


def transfer_time(m: ModelShape, host_bandwidth: float, mem_bandwidth: float, s: StepShape) -> float:
    """The step's KV moves, run before the forward pass: host link, and device copies (read + write)."""
    if not (s.host_transfer_tokens or s.copy_tokens):
        return 0.0
    per_token = m.kv_bytes_per_token
    return s.host_transfer_tokens * per_token / host_bandwidth + 2.0 * s.copy_tokens * per_token / mem_bandwidth


def load_cost_model(hardware: str, model_config: ModelConfig, tensor_parallel_size: int = 1,
                    link_bandwidth: Optional[float] = None, collective_latency_s: Optional[float] = None,
                    fp8_weights: bool = False, fp8_kv_cache: bool = False, expert_parallel: bool = False):
    """`h200` / `h100` (roofline presets), a hardware JSON ({"matmul_flops", "mem_bandwidth", ...,
    "link_bandwidth", "collective_latency_s", "fp8_matmul_flops"}), or a profile JSON written by `tallyserve
    profile`. `link_bandwidth` (bytes/s) and `collective_latency_s` override the hardware's; ``fp8_weights`` /
    ``fp8_kv_cache`` price FP8 projections (bytes and tensor-core rate) and an FP8 KV cache (a profile was measured
    with whatever the engine ran). ValueError for a tensor_parallel_size the model cannot be split over, or > 1
    with a profile."""
    check_tensor_parallel(model_config, tensor_parallel_size)
    if hardware in HARDWARE:
        hw, source = HARDWARE[hardware], hardware
    else:
        path = Path(hardware)
        if not path.is_file():
            raise ValueError(f"--hardware must be one of {sorted(HARDWARE)} or a JSON file, got {hardware!r}")
        data = json.loads(path.read_text())
        if "step_time_s" in data:
            if tensor_parallel_size != int(data.get("tensor_parallel_size", 1)):
                raise ValueError(f"{hardware}: a profile holds step times measured at tensor_parallel_size "
                                 f"{data.get('tensor_parallel_size', 1)}, not {tensor_parallel_size}; price tensor "
                                 "parallelism with the roofline (--hardware h200 or a hardware JSON)")

            from tallyserve.sim.profile_cost import ProfileCostModel  # it builds on this module

            return ProfileCostModel(data, model_config)
        try:
            hw, source = HardwareSpec(**{"name": path.stem, **data}), hardware
        except TypeError as exc:
            raise ValueError(f"{hardware}: not a profile nor a hardware spec: {exc}") from None
        if not (hw.matmul_flops > 0 and hw.mem_bandwidth > 0 and math.isfinite(hw.mem_bytes)):
            raise ValueError(f"{hardware}: matmul_flops and mem_bandwidth must be > 0")
    if link_bandwidth is not None:
        hw = replace(hw, link_bandwidth=float(link_bandwidth))
    if collective_latency_s is not None:
        hw = replace(hw, collective_latency_s=float(collective_latency_s))
    if not (hw.link_bandwidth > 0 and math.isfinite(hw.link_bandwidth)):
        raise ValueError(f"{source}: link_bandwidth must be a finite number > 0, got {hw.link_bandwidth!r}")
    if not (hw.collective_latency_s >= 0 and math.isfinite(hw.collective_latency_s)):
        raise ValueError(f"{source}: collective_latency_s must be a finite number >= 0, "
                         f"got {hw.collective_latency_s!r}")
    return RooflineCostModel(model_config, hw, tensor_parallel_size, fp8_weights, fp8_kv_cache, expert_parallel)
