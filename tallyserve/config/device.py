"""The device and the dtypes an engine runs with, resolved from EngineArgs' names."""

from __future__ import annotations

from typing import Optional

import torch

from tallyserve import envs

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    """``auto``: $TALLYSERVE_DEVICE when set (e.g. ``cpu`` on a CUDA machine), else CUDA if available."""
    if name == "auto":
        name = envs.TALLYSERVE_DEVICE or "auto"
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
            raise ValueError(f"TALLYSERVE_DEVICE must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The model's dtype: its activations, norms, attention and KV cache. bf16 by default on GPU, float32 on
    CPU (exact parity and fast CPU kernels). On the CPU, "bfloat16" keeps float32 here and stores the
    projections in bfloat16 instead (``resolve_matmul_dtype``)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu" and _DTYPES[name] == torch.bfloat16:
        return torch.float32
    return _DTYPES[name]


def resolve_matmul_dtype(name: str, device: torch.device) -> Optional[torch.dtype]:
    """The dtype of the projections' weights and matmuls when it differs from the model's, else None.
    On the CPU, dtype="bfloat16" means bfloat16 weights and matmuls (AMX / AVX512-BF16 where the CPU has them,
    3-7x the float32 matmul rate from 64 rows on) under float32 norms, RoPE, attention and KV cache: half the
    weight memory, and no bfloat16 rounding of the residual stream or the cache."""
    if device.type == "cpu" and name in _DTYPES and _DTYPES[name] == torch.bfloat16:
        return torch.bfloat16
    return None


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" is e4m3


def resolve_kv_cache_dtype(name: str, device: torch.device, kv_cache_dtype: str = "auto") -> torch.dtype:
    """The KV cache's dtype. ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``: FP8 e4m3 (keys and values divided by the
    layer's k_scale / v_scale, 1.0 unless the checkpoint has them, and rounded once, when written; half a bf16
    cache's bytes, so twice the blocks). ``"auto"``: the model's, except on the CPU with dtype="bfloat16", whose
    cache is bfloat16 too (half the bytes that decode attention reads; keys and values are rounded once, when
    written)."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return torch.bfloat16 if resolve_matmul_dtype(name, device) == torch.bfloat16 else resolve_dtype(name, device)
