"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, SiLU-gated MLP.

Numerics follow the Hugging Face reference implementations so that parity tests can be tight:
RMSNorm normalises in float32 and scales in the input dtype; RoPE uses the non-interleaved
"rotate half" layout (the first half of each head pairs with the second half).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    the meta device needs no re-initialisation); the CPU inv_freq is copied per device lazily."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, scaling)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin, each float32 (T, head_dim)."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) by per-token angles (cos/sin (T, D)), rotate-half layout; computed in
    float32, returned in x's dtype."""
    xf = x.to(torch.float32)
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.to(x.dtype)


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_weight: Optional[torch.Tensor] = None  # set by fuse()

    @torch.no_grad()
    def fuse(self) -> None:
        """One gate/up projection; the two Linear weights become views of it (no extra memory)."""
        if self.gate_proj.bias is not None:
            return  # rare; the separate projections stay
        n = self.gate_proj.weight.shape[0]
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_proj.weight.data = self.gate_up_weight[:n]
        self.up_proj.weight.data = self.gate_up_weight[n:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            from tallyserve.models.fused_ops import silu_mul

            return self.down_proj(silu_mul(F.linear(x, self.gate_up_weight)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
