"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, SiLU-gated MLP, and
the tensor-parallel linear / embedding layers (vLLM's names).

Numerics follow the Hugging Face reference implementations so that parity tests can be tight:
RMSNorm normalises in float32 and scales in the input dtype; RoPE uses the non-interleaved
"rotate half" layout (the first half of each head pairs with the second half).

Tensor parallelism (Megatron-style): each parallel layer holds one rank's slice of the
checkpoint tensor, described by a ``ShardSpec`` that the loader uses to read just that slice.
At ``tp_size == 1`` every parallel layer computes exactly what ``nn.Linear`` / ``nn.Embedding``
compute (same calls), and ``shard_specs()`` is empty.
  * ``ColumnParallelLinear``: output features split; no communication (its output stays local).
  * ``RowParallelLinear``: input features split; partial products summed by one all-reduce, the
    bias (replicated) added once, after the reduce.
  * ``VocabParallelEmbedding``: vocab rows split in ``ceil(vocab / tp_size)`` per rank (the last
    rank's tail is zero padding); ids outside a rank's slice give zeros, then one all-reduce.
  * ``ParallelLMHead``: the same vocab slice as the embedding (so tied weights just work); the
    local logits are gathered onto rank 0 (``compute_logits``).

Every projection goes through ``linear``: a bfloat16 weight under float32 activations (the CPU's
``dtype="bfloat16"``, see ``LlamaForCausalLM.set_matmul_dtype``) runs the product in bfloat16 (AMX /
AVX512-BF16 on CPUs that have them) and hands float32 back to the norms, RoPE, attention and KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tallyserve.config.quantization import Fp8Config
from tallyserve.distributed import parallel_state
from tallyserve.kernels import fused_ops, gemv
from tallyserve.models.cpu_products import CPU_GEMV_MAX_ROWS, cpu_gemv_serves
from tallyserve.quantization.fp8 import FP8_DTYPE, Fp8Weight, fp8_linear

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``F.linear``, returned in ``out_dtype`` (default x's dtype). With a weight stored in another dtype than
    ``x`` (bfloat16 weights, float32 activations), x is rounded to the weight's dtype for the product and the
    bias (kept in the model's dtype) is added to the converted product. An ``Fp8Weight`` goes to the FP8
    product (``quantization.fp8.fp8_linear``)."""
    if isinstance(weight, Fp8Weight):  # an FP8 projection (quantization="fp8" or an FP8 checkpoint)
        return fp8_linear(x, weight, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    if gemv.usable(x, weight):  # one row on CUDA: the batch-1 decode step
        out = gemv.gemv(x, weight, out_dtype)
        return out if bias is None else out.add_(bias)
    panels = getattr(weight, "sgemm_packed", None)  # cpu_products.pack_sgemm_weight: float32 on the AVX2 kernel
    if panels is not None and x.dim() == 2 and x.dtype == torch.float32:
        _check_inner(x, weight)
        out = torch.ops.tallyserve_cpu.linear_sgemm(x.contiguous(), panels, weight.shape[0]).to(out_dtype)
        return out if bias is None else out.add_(bias)
    packed = getattr(weight, "mkldnn_packed", None)  # cpu_products.pack_cpu_weight: the CPU's blocked projections
    if packed is not None and x.dim() == 2 and (x.shape[0] > CPU_GEMV_MAX_ROWS or weight.dtype == torch.float32):
        out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype).contiguous(), packed, None, "none", [], "")
        out = out.to(out_dtype)
        return out if bias is None else out.add_(bias)
    if weight.dtype == torch.bfloat16 and x.dim() == 2 and 0 < x.shape[0] <= CPU_GEMV_MAX_ROWS and \
            cpu_gemv_serves(weight):
        # one to four rows on the CPU (decode of a few sequences): a kernel that streams the bf16 weights
        _check_inner(x, weight)
        out = torch.ops.tallyserve_cpu.gemv_bf16(x.to(torch.bfloat16).contiguous(), weight).to(out_dtype)
        return out if bias is None else out.add_(bias)
    if weight.dtype == x.dtype == out_dtype and (bias is None or bias.dtype == out_dtype):
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight).to(out_dtype)
    return out if bias is None else out.add_(bias)


def _check_inner(x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError before a compiled CPU product (cpu_kernels: an error from the kernel is unsafe on some hosts)
    unless x's features are the weight's input features."""
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match the weight {tuple(weight.shape)}")


# GatedMLP on the CPU: rows per piece of a long chunk, float32 and bfloat16 weights. oneDNN's bfloat16 kernels
# change at 2,048 rows: the down projection (1,536 -> 576) ran 1.0 TFLOP/s at 1,024 rows and 2.1 at 2,048, so
# the bundled model's MLP over 4,096 rows took 18.9 ms in pieces of 1,024 and 13.8 in pieces of 2,048. Float32
# is faster in pieces of 1,024 (8,192 rows: 163-173 ms against 206-225).
CPU_MLP_CHUNK_ROWS = 1024
CPU_MLP_CHUNK_ROWS_BF16 = 2048


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency remapping: long wavelengths are slowed by ``factor``, short ones kept,
    and the band between is blended linearly in 1/wavelength."""
    try:
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig_ctx = float(scaling["original_max_position_embeddings"])
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling needs {exc.args[0]!r}; got {scaling}") from None
    if high <= low:
        raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor; got {scaling}")
    wavelen = 2 * math.pi / inv_freq
    slow_band = wavelen > orig_ctx / low  # long wavelengths: divide by factor
    fast_band = wavelen < orig_ctx / high  # short wavelengths: unchanged
    blend = (orig_ctx / wavelen - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(slow_band, inv_freq / factor, blended)
    return torch.where(fast_band, inv_freq, out)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32 on the CPU, after any supported scaling."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions. Holds no parameters or buffers (so a model built on
    the meta device needs no re-initialisation); the CPU inv_freq is copied per device lazily.

    Given ``max_position`` (the largest position the step can hold, known on the host), the rows come
    from a per-device table of positions [0, n) built once with the same operations (so the values are
    bit-identical): one gather per forward instead of five elementwise kernels (a decode step's CUDA
    graph replays it at every step). The table grows to cover a larger bound when one arrives."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, scaling)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self._table_by_device: dict[torch.device, torch.Tensor] = {}  # (n, 2 * head_dim): cos | sin
        self._outgrown: list[torch.Tensor] = []  # replaced tables stay alive: a captured CUDA graph may read one

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def table(self, device: torch.device, num_positions: int) -> torch.Tensor:
        """The (n >= num_positions, 2 * head_dim) float32 table of ``device``: cos then sin of each position."""
        device = torch.device(device)
        table = self._table_by_device.get(device)
        if table is None or table.shape[0] < num_positions:
            n = max(num_positions, 2 * table.shape[0] if table is not None else 0)
            if table is not None:
                self._outgrown.append(table)
            cos, sin = self._cos_sin(torch.arange(n, dtype=torch.int64, device=device))
            table = self._table_by_device[device] = torch.cat((cos, sin), dim=-1)
        return table

    def forward(self, positions: torch.Tensor, max_position: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin, each float32 (T, head_dim) (views with row stride 2 * head_dim when
        they come from the table). ``max_position``: an upper bound of ``positions`` (from the table then)."""
        if max_position is None:
            return self._cos_sin(positions)
        rows = self.table(positions.device, max_position + 1)[positions]
        return rows[:, : self.head_dim], rows[:, self.head_dim:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) by per-token angles (cos/sin (T, D)), rotate-half layout; computed in
    float32, returned in x's dtype."""
    xf = x.to(torch.float32)
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.to(x.dtype)


@dataclass(frozen=True)
class ShardSpec:
    """The part of a checkpoint tensor one rank holds: ``[start, start + size)`` along ``dim`` of a
    tensor that is ``full_size`` long there. The local parameter may be longer than ``size`` along
    ``dim`` (vocab padding); those extra rows are zero."""

    dim: int
    start: int
    size: int
    full_size: int


def even_shard(full_size: int, tp_size: int, tp_rank: int, dim: int = 0) -> ShardSpec:
    """Rank ``tp_rank``'s equal share of ``full_size`` (which ``tp_size`` must divide)."""
    if full_size % tp_size:
        raise ValueError(f"{full_size} is not divisible by tp_size={tp_size}")
    size = full_size // tp_size
    return ShardSpec(dim, tp_rank * size, size, full_size)


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[ShardSpec, int]:
    """(rank's vocab slice, rows per rank): ``ceil(vocab / tp_size)`` rows each, the last rank's
    slice shorter (or empty) and padded with zero rows."""
    per_partition = -(-vocab_size // tp_size)
    start = min(tp_rank * per_partition, vocab_size)
    return ShardSpec(0, start, min(per_partition, vocab_size - start), vocab_size), per_partition


class _ProjectionLinear(nn.Linear):
    """A projection that may store its weight in FP8 (``quant``: the model's FP8 scheme, applied when it covers
    ``prefix``, the projection's checkpoint name): then ``weight`` is e4m3 of the same shape, ``weight_scale``
    float32 (one per output row, or per block), ``input_scale`` the static activation scale if the scheme has
    one, and ``fp8`` the (block, activation) layout; ``projection_weight`` hands ``linear`` the three together.
    On a device without FP8 products the loader turns it back into a plain weight (``dequantize_fp8``)."""

    def _init_fp8(self, quant: Optional[Fp8Config], prefix: str) -> None:
        self.fp8: Optional[tuple[Optional[tuple[int, int]], str]] = None
        if quant is None or not quant.is_quantized(prefix):
            return
        n, k = self.weight.shape
        device = self.weight.device
        block = quant.block_size
        scale_shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        self.weight = nn.Parameter(torch.empty((n, k), dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                         requires_grad=False)
        if quant.static_input_scale:
            self.input_scale = nn.Parameter(torch.empty((), dtype=torch.float32, device=device), requires_grad=False)
        self.fp8 = (block, quant.activation)

    def projection_weight(self) -> torch.Tensor | Fp8Weight:
        """The weight as ``linear`` takes it: the tensor, or an FP8 weight with its scales."""
        if self.fp8 is None:
            return self.weight
        return Fp8Weight(self.weight, self.weight_scale, self.fp8[0], self.fp8[1],
                         self.input_scale if self.fp8[1] == "static" else None)

    @torch.no_grad()
    def dequantize_fp8(self, dtype: torch.dtype) -> None:
        """Store the weight FP8 stands for in ``dtype`` and drop the scales: a plain projection from now on."""
        if self.fp8 is None:
            return
        weight = self.projection_weight().dequantize(dtype)
        del self.weight_scale
        if self.fp8[1] == "static":
            del self.input_scale
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.fp8 = None


@torch.no_grad()
def fuse_projections(projs: Sequence[_ProjectionLinear], dtype: Optional[torch.dtype] = None) -> torch.Tensor | Fp8Weight:
    """One weight for projections that share their input, stacked by output rows (in ``dtype``, default their
    own; FP8 weights stay FP8, their scales stacked too). Each projection's weight (and scales) become views of it:
    no extra memory."""
    if projs[0].fp8 is None:
        fused = torch.cat([p.weight for p in projs]).to(dtype or projs[0].weight.dtype)
        weights, scales = fused, None
    else:
        fused = Fp8Weight.cat([p.projection_weight() for p in projs])
        weights, scales = fused.weight, fused.scale
    row = scale_row = 0
    for p in projs:
        rows = p.weight.shape[0]
        p.weight.data = weights[row:row + rows]
        row += rows
        if scales is not None:
            scale_rows = p.weight_scale.shape[0]
            p.weight_scale.data = scales[scale_row:scale_row + scale_rows]
            scale_row += scale_rows
    return fused


class ColumnParallelLinear(_ProjectionLinear):
    """y_local = x W_local^T + b_local with W's output rows split across ranks (``shard``: which
    rows; default an even split). The output stays local (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp_size: int = 1,
                 tp_rank: int = 0, shard: Optional[ShardSpec] = None, quant: Optional[Fp8Config] = None,
                 prefix: str = "") -> None:
        self.tp_size = tp_size
        self.shard = shard or even_shard(output_size, tp_size, tp_rank, dim=0)
        super().__init__(input_size, self.shard.size, bias=bias)
        self._init_fp8(quant, prefix)

    def shard_specs(self) -> dict[str, ShardSpec]:
        if self.tp_size == 1:
            return {}
        return {"weight": self.shard, **({"bias": self.shard} if self.bias is not None else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.projection_weight(), self.bias)


class RowParallelLinear(_ProjectionLinear):
    """y = all_reduce(x_local W_local^T) + b, with W's input columns split across ranks and the
    bias replicated (added once, after the reduce)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp_size: int = 1,
                 tp_rank: int = 0, quant: Optional[Fp8Config] = None, prefix: str = "") -> None:
        self.tp_size = tp_size
        self.shard = even_shard(input_size, tp_size, tp_rank, dim=1)
        super().__init__(self.shard.size, output_size, bias=bias)
        self._init_fp8(quant, prefix)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.shard} if self.tp_size > 1 else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.projection_weight(), self.bias)
        return self.reduce(linear(x, self.projection_weight()))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's product ``x_local W_local^T`` -> the layer's output (all-reduce, then the bias)."""
        out = parallel_state.all_reduce(partial) if self.tp_size > 1 else partial
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose vocab rows are split across ranks (see ``vocab_shard``): ids outside this
    rank's slice look up zeros, and one all-reduce assembles the full embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_size: int = 1, tp_rank: int = 0) -> None:
        self.tp_size = tp_size
        self.shard, per_partition = vocab_shard(num_embeddings, tp_size, tp_rank)
        super().__init__(per_partition, embedding_dim)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.shard} if self.tp_size > 1 else {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        lo, hi = self.shard.start, self.shard.start + self.shard.size
        outside = (input_ids < lo) | (input_ids >= hi)
        out = F.embedding((input_ids - lo).masked_fill(outside, 0), self.weight)
        return parallel_state.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Linear):
    """Output projection over this rank's vocab slice (the embedding's slice, so weights can be
    tied); ``compute_logits`` gathers the full vocab onto rank 0."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_size: int = 1, tp_rank: int = 0) -> None:
        self.tp_size = tp_size
        self.vocab_size = num_embeddings
        self.shard, per_partition = vocab_shard(num_embeddings, tp_size, tp_rank)
        super().__init__(embedding_dim, per_partition, bias=False)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.shard} if self.tp_size > 1 else {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden (N, embedding_dim) -> float32 (N, vocab) on rank 0; None on the other ranks."""
        if self.tp_size == 1:
            return linear(hidden, self.weight).float()
        logits = parallel_state.gather_last_dim(linear(hidden, self.weight), dst=0)
        return None if logits is None else logits[:, : self.vocab_size].float()


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, tp_size: int = 1,
                 tp_rank: int = 0, quant: Optional[Fp8Config] = None, prefix: str = "") -> None:
        super().__init__()
        tp = dict(tp_size=tp_size, tp_rank=tp_rank, quant=quant)
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, prefix=f"{prefix}.gate_proj", **tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, prefix=f"{prefix}.up_proj", **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj", **tp)
        self.gate_up_weight: Optional[torch.Tensor | Fp8Weight] = None  # set by fuse()

    @torch.no_grad()
    def fuse(self, dtype: Optional[torch.dtype] = None) -> None:
        """One gate/up projection (in ``dtype``, default the weights' own); the two Linear weights become
        views of it (no extra memory)."""
        if self.gate_proj.bias is not None or (self.gate_proj.fp8 is None) != (self.up_proj.fp8 is None):
            return  # rare; the separate projections stay
        self.gate_up_weight = fuse_projections([self.gate_proj, self.up_proj], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            rows = x.shape[0]
            piece = CPU_MLP_CHUNK_ROWS_BF16 if self.gate_up_weight.dtype == torch.bfloat16 else CPU_MLP_CHUNK_ROWS
            if x.device.type == "cpu" and self.down_proj.tp_size == 1 and rows > piece:
                # On the CPU a long chunk goes through in pieces of rows, so each piece's (rows, 2 * intermediate)
                # activation stays in cache between the three steps: 8192 rows of the bundled model's MLP took
                # 164 ms whole and 120 ms in pieces (float32; bfloat16 40 -> 20 ms).
                out = None
                for lo in range(0, rows, piece):
                    part = self.down_proj(fused_ops.silu_mul(linear(x[lo:lo + piece], self.gate_up_weight)))
                    if out is None:
                        out = part.new_empty((rows, part.shape[1]))
                    out[lo:lo + part.shape[0]] = part
                return out
            gate_up = linear(x, self.gate_up_weight)
            down = self.down_proj
            if gemv.usable(gate_up, down.weight):
                # one row on CUDA: the down projection applies SiLU-and-multiply as it loads its input
                return down.reduce(gemv.gemv(gate_up, down.weight, silu_mul_input=True))
            if down.fp8 is not None and gemv.usable_fp8(gate_up, down.weight):  # the same with an FP8 weight
                return down.reduce(gemv.gemv(gate_up, down.weight, silu_mul_input=True, scale=down.weight_scale,
                                             scale_block=down.fp8[0]))
            # dtype="bfloat16" on the CPU: x arrives in bfloat16, so gate/up, SiLU-mul and down stay in it
            return self.down_proj(fused_ops.silu_mul(gate_up))
        if self.gate_proj.bias is not None:  # a bfloat16 x (dtype="bfloat16"): biases, SiLU-mul in the model's dtype
            x = x.to(self.gate_proj.bias.dtype)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
