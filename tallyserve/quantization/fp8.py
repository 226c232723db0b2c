"""FP8 e4m3 numerics and the FP8 projection.

A quantized projection holds ``Fp8Weight``: the weight in ``torch.float8_e4m3fn`` (N, K) and float32 scales, one
per output row (``block`` None: per-channel and per-tensor checkpoints both become this) or one per
``block = (bn, bk)`` tile ((ceil(N / bn), ceil(K / bk))). ``weight ~= fp8 * scale``. Activations are quantized
as the scheme says: per token (row), per token and group of ``bk`` columns (the block format), per tensor, or with
the checkpoint's static ``input_scale``.

``fp8_linear`` computes ``x @ W^T``: on CUDA with FP8 tensor cores the activations are quantized and the product
runs in FP8 (``kernels/fp8_gemm``: ``torch._scaled_mm`` for per-channel scales, a Triton kernel for block scales, a
Triton GEMV for one row that reads the FP8 weight and scales it in registers); elsewhere it is the reference
arithmetic in float32 (what the GPU kernels are tested against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tallyserve.kernels import fp8_gemm

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or block gets this scale (its values quantize to 0 either way)
ACTIVATIONS = ("token", "group", "tensor", "static")


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale) into e4m3, saturated at +-448 (``scale`` broadcasts against x)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / FP8_MAX).clamp_(min=_MIN_SCALE)


def _block_view(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """(N, K) zero-padded to whole blocks and viewed as (N / bn, bn, K / bk, bk)."""
    n, k = x.shape
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        x = F.pad(x, (0, pk, 0, pn))
    return x.view((n + pn) // bn, bn, (k + pk) // bk, bk)


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """(ceil(N / bn), ceil(K / bk)) block scales -> (N, K), each block's scale over its elements."""
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


# clipping ratios ``quantize_weight(search=True)`` tries per row: the scale is ratio x amax / 448
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def quantize_weight(w: torch.Tensor, block: Optional[tuple[int, int]] = None,
                    search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scales) of a (N, K) weight: one scale per row, or per ``block``. ``search`` (per row
    only): of the scales ratio x amax / 448 for the ``CLIP_RATIOS``, each row takes the one whose e4m3 values
    reconstruct it with the least squared error (saturating a few outliers buys finer steps for the rest: on the
    bundled SmolLM2 the perplexity cost of FP8 weights went from +3.2% to +2.2%)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight, got shape {tuple(w.shape)}")
    if block is None:
        amax = w.abs().amax(dim=1)
        scale = _amax_scale(amax)
        if search:
            wf = w.float()
            best = None
            for ratio in CLIP_RATIOS:
                trial = _amax_scale(amax * ratio)
                err = (to_fp8(wf, trial[:, None]).float() * trial[:, None] - wf).square_().sum(dim=1)
                if best is None:
                    best = err
                    scale = trial
                else:
                    better = err < best
                    best = torch.where(better, err, best)
                    scale = torch.where(better, trial, scale)
        return to_fp8(w, scale[:, None]), scale
    bn, bk = block
    scale = _amax_scale(_block_view(w.abs(), bn, bk).amax(dim=(1, 3)))
    return to_fp8(w, expand_block_scale(scale, tuple(w.shape), block)), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 weight and its scales stand for, in ``dtype``."""
    if block is None:
        full = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    else:
        full = expand_block_scale(scale.float(), tuple(q.shape), block)
    return (q.float() * full).to(dtype)


def quantize_activation(x: torch.Tensor, activation: str, group: int = 128,
                        input_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, float32 scales) of a (M, K) activation: scales (M, 1) for "token", "tensor" and "static" (the
    per-tensor scale repeated per row, as the row-wise products take it), (M, ceil(K / group)) for "group"."""
    m, k = x.shape
    if activation == "token":
        scale = _amax_scale(x.abs().amax(dim=1, keepdim=True))
        return to_fp8(x, scale), scale
    if activation == "group":
        groups = -(-k // group)
        padded = F.pad(x, (0, groups * group - k)) if k % group else x
        scale = _amax_scale(padded.abs().view(m, groups, group).amax(dim=2))
        return to_fp8(x, scale.repeat_interleave(group, 1)[:, :k]), scale
    if activation == "tensor":
        scale = _amax_scale(x.abs().amax()).reshape(1, 1)
    elif activation == "static":
        if input_scale is None:
            raise ValueError("static activation quantization needs the checkpoint's input_scale")
        scale = input_scale.float().reshape(1, 1)
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return to_fp8(x, scale), scale.expand(m, 1).contiguous()


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    if scale.shape[1] == 1:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, 1)[:, : q.shape[1]]


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 projection weight: ``weight`` (N, K) e4m3, ``scale`` float32 (N,) or per ``block`` tile,
    ``activation`` how its input is quantized (ACTIVATIONS), ``input_scale`` the static one (a 0-d tensor)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: Optional[tuple[int, int]] = None
    activation: str = "token"
    input_scale: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.scale, self.block, dtype)

    @staticmethod
    def cat(parts: Sequence["Fp8Weight"]) -> "Fp8Weight":
        """The projections ``parts`` stacked along their output rows (fused q/k/v, gate/up): their weights and
        scales concatenated (block scales by block rows: every part's rows must be whole blocks), and the largest
        static input scale (the activation is quantized once for all of them)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.block, p.activation, p.weight.shape[1]) != (first.block, first.activation, first.weight.shape[1]):
                raise ValueError("cannot fuse FP8 projections with different layouts")
        if first.block is not None:
            for p in parts[:-1]:
                if p.weight.shape[0] % first.block[0]:
                    raise ValueError(f"cannot fuse block-scaled FP8 projections: {p.weight.shape[0]} rows are not "
                                     f"whole blocks of {first.block[0]}")
        statics = [p.input_scale for p in parts if p.input_scale is not None]
        input_scale = torch.stack([s.reshape(()) for s in statics]).amax() if statics else None
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), first.block,
                         first.activation, input_scale)


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None,
                         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x @ W^T the way the FP8 kernels compute it, in float32: the activation quantized as the scheme says and
    dequantized, times the dequantized weight."""
    group = w.block[1] if w.block else 128
    xq, xs = quantize_activation(x.reshape(-1, x.shape[-1]), w.activation, group, w.input_scale)
    out = dequantize_activation(xq, xs, group) @ w.dequantize().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).reshape(*x.shape[:-1], w.weight.shape[0])


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` in ``out_dtype`` (default x's): the FP8 kernels on a CUDA device that has FP8 tensor
    cores (compute capability 8.9+), else the float32 reference."""
    if x.is_cuda and fp8_gemm.supported(x.device):
        return fp8_gemm.linear(x, w.weight, w.scale, w.block, w.activation, w.input_scale, bias, out_dtype or x.dtype)
    return fp8_linear_reference(x, w, bias, out_dtype)
