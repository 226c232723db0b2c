"""Step time of a forward pass: a roofline of the model's shape on named hardware, or a
measured profile (`tallyserve profile`) interpolated over (batch size, new tokens, context).

Inputs are the numbers the ledger charged for the step (`StepShape`), nothing else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.models.model_config import ModelConfig, kv_bytes_per_token

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


# Measured on the H200 machines (docs/benchmarks.md): ~700 TFLOP/s bf16 matmul, ~4.27 TB/s copy, 141 GB.
HARDWARE = {"h200": HardwareSpec("h200", 700e12, 4.27e12, 141e9)}


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

    @classmethod
    def of(cls, so: SchedulerOutput) -> "StepShape":
        tokens = decode = sampled = ctx = pairs = 0
        for e in so.requests:
            n, s = len(e.token_ids), e.start_position
            tokens += n
            ctx += s + n
            pairs += n * s + n * (n + 1) // 2
            decode += n == 1
            sampled += e.sample
        moves = so.kv_transfers
        host = sum(c.num_tokens for c in moves.offloads) + sum(c.num_tokens for c in moves.restores) if moves else 0
        copies = sum(c.num_tokens for c in moves.copies) if moves else 0
        return cls(tokens, len(so.requests), decode, sampled, ctx, pairs, host, copies)


@dataclass(frozen=True)
class ModelShape:
    """FLOP and byte counts of a decoder-only transformer, from its config."""

    linear_params: int  # q, k, v, o and MLP weights of all layers
    lm_head_params: int
    embed_params: int
    attn_flops_per_pair: int  # QK^T and PV, all layers and heads
    kv_bytes_per_token: int  # K and V of all layers, bf16

    @classmethod
    def of(cls, mc: ModelConfig) -> "ModelShape":
        h, q, kv, d = mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        per_layer = h * q * d + 2 * h * kv * d + q * d * h + 3 * h * mc.intermediate_size
        vocab = mc.vocab_size * h
        return cls(
            linear_params=mc.num_hidden_layers * per_layer,
            lm_head_params=vocab,
            embed_params=0 if mc.tie_word_embeddings else vocab,
            attn_flops_per_pair=4 * mc.num_hidden_layers * q * d,
            kv_bytes_per_token=kv_bytes_per_token(mc, BF16_BYTES),
        )

    @property
    def weight_bytes(self) -> int:
        return BF16_BYTES * (self.linear_params + self.lm_head_params + self.embed_params)


class RooflineCostModel:
    """max(compute, memory) for the linear layers and for attention, plus per-step overheads."""

    def __init__(self, model_config: ModelConfig, hw: HardwareSpec) -> None:
        self.hw = hw
        self.shape = ModelShape.of(model_config)
        self.mem_bytes = hw.mem_bytes
        self.name = f"roofline:{hw.name}"

    def step_time(self, s: StepShape) -> float:
        hw, m = self.hw, self.shape
        lin_flops = 2.0 * m.linear_params * s.num_tokens + 2.0 * m.lm_head_params * s.num_sampled
        lin_bytes = BF16_BYTES * (m.linear_params + (m.lm_head_params if s.num_sampled else 0))
        t_lin = max(lin_flops / hw.matmul_flops, lin_bytes / hw.mem_bandwidth)
        attn_flops = float(m.attn_flops_per_pair) * s.attn_pairs
        kv_bytes = float(m.kv_bytes_per_token) * (s.context_tokens + s.num_tokens)  # read all, write new
        t_attn = max(attn_flops / hw.matmul_flops, kv_bytes / hw.mem_bandwidth)
        return (t_lin + t_attn + transfer_time(m, hw.host_bandwidth, hw.mem_bandwidth, s)
                + hw.step_overhead_s + hw.per_request_overhead_s * s.num_requests)


def transfer_time(m: ModelShape, host_bandwidth: float, mem_bandwidth: float, s: StepShape) -> float:
    """The step's KV moves, run before the forward pass: host link, and device copies (read + write)."""
    if not (s.host_transfer_tokens or s.copy_tokens):
        return 0.0
    per_token = m.kv_bytes_per_token
    return s.host_transfer_tokens * per_token / host_bandwidth + 2.0 * s.copy_tokens * per_token / mem_bandwidth


def _locate(axis: Sequence[float], x: float) -> tuple[int, float]:
    """Segment index and fraction of `x` on `axis` (fraction > 1 past the last point; clamped at 0)."""
    if len(axis) == 1:
        return 0, 0.0
    i = 0
    while i < len(axis) - 2 and x > axis[i + 1]:
        i += 1
    return i, max(0.0, (x - axis[i]) / (axis[i + 1] - axis[i]))


def _lerp(a: float, b: float, f: float) -> float:
    """Linear between a and b; past b it extrapolates with a non-negative slope, so noisy
    measurements never make a bigger step cheaper than the grid's edge."""
    if f <= 1.0:
        return a + f * (b - a)
    return b + (f - 1.0) * max(b - a, 0.0)


class ProfileCostModel:
    """Interpolation of measured step times, one axis after another (linear inside the grid,
    non-decreasing linear extrapolation past its far edges, clamped below its near edges).

    A profile holds axes `batch_size` (requests in the step), `extra_tokens` (new tokens beyond
    one per request, i.e. prefill tokens) and `context_len` (mean KV length per request), and
    `step_time_s[b][e][c]` over their product.
    """

    def __init__(self, profile: dict, model_config: Optional[ModelConfig] = None) -> None:
        try:
            self.axes = [list(map(float, profile[k])) for k in ("batch_size", "extra_tokens", "context_len")]
            self.table = profile["step_time_s"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile is missing {exc}: run `tallyserve profile` to make one") from None
        for axis in self.axes:
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError("profile axes must be non-empty and strictly increasing")
        shape = (len(self.axes[0]), len(self.axes[1]), len(self.axes[2]))
        if len(self.table) != shape[0] or any(len(r) != shape[1] or any(len(c) != shape[2] for c in r)
                                              for r in self.table):
            raise ValueError(f"profile step_time_s must have shape {shape}")
        self.mem_bytes = float(profile.get("memory_bytes") or HARDWARE["h200"].mem_bytes)
        self.name = f"profile:{profile.get('device', 'unknown')}"
        # KV moves are not in the grid: priced from the model's shape and the profile's bandwidths.
        self.shape = ModelShape.of(model_config) if model_config is not None else None
        self.host_bandwidth = float(profile.get("host_bandwidth") or HARDWARE["h200"].host_bandwidth)
        self.mem_bandwidth = float(profile.get("mem_bandwidth") or HARDWARE["h200"].mem_bandwidth)

    def step_time(self, s: StepShape) -> float:
        b = max(s.num_requests, 1)
        (bi, bf), (ei, ef), (ci, cf) = (_locate(axis, x) for axis, x in
                                        zip(self.axes, (b, s.num_tokens - s.num_requests, s.context_tokens / b)))
        nb, ne, nc = (min(1, len(a) - 1) for a in self.axes)  # 0 on a single-point axis

        def along_c(i: int, j: int) -> float:
            row = self.table[i][j]
            return _lerp(row[ci], row[ci + nc], cf)

        def along_e(i: int) -> float:
            return _lerp(along_c(i, ei), along_c(i, ei + ne), ef)

        moves = transfer_time(self.shape, self.host_bandwidth, self.mem_bandwidth, s) if self.shape else 0.0
        return max(_lerp(along_e(bi), along_e(bi + nb), bf), 1e-7) + moves


def load_cost_model(hardware: str, model_config: ModelConfig):
    """`h200` (a roofline preset), a hardware JSON ({"matmul_flops", "mem_bandwidth", ...}), or a
    profile JSON written by `tallyserve profile`."""
    if hardware in HARDWARE:
        return RooflineCostModel(model_config, HARDWARE[hardware])
    path = Path(hardware)
    if not path.is_file():
        raise ValueError(f"--hardware must be one of {sorted(HARDWARE)} or a JSON file, got {hardware!r}")
    data = json.loads(path.read_text())
    if "step_time_s" in data:
        return ProfileCostModel(data, model_config)
    try:
        hw = HardwareSpec(**{"name": path.stem, **data})
    except TypeError as exc:
        raise ValueError(f"{hardware}: not a profile nor a hardware spec: {exc}") from None
    if not (hw.matmul_flops > 0 and hw.mem_bandwidth > 0 and math.isfinite(hw.mem_bytes)):
        raise ValueError(f"{hardware}: matmul_flops and mem_bandwidth must be > 0")
    return RooflineCostModel(model_config, hw)
