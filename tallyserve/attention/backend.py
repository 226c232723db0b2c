"""The attention backend interface: what a model layer calls to write and read its paged KV cache.

Every backend owns both halves of one layer's attention step: it writes the new keys/values into
the layer's cache at ``meta.slot_mapping`` and then attends each request's queries over that
request's cached context (causally). Models never touch the cache layout themselves.

KV cache layout (one tensor per layer), shared by every backend:
    ``(2, num_blocks, block_size, num_kv_heads, head_dim)``; ``[0]`` holds K, ``[1]`` holds V.
A token's flat slot is ``block_id * block_size + offset``; slot ``-1`` marks a padding row that
must not be written. Padding rows may trail the last request (q may have more rows than
``query_start_loc[-1]``); their output is zero.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tallyserve.attention.metadata import AttentionMetadata, OutputRows

PADDING_SLOT = -1


FP8_KV_DTYPE = torch.float8_e4m3fn  # kv_cache_dtype="fp8"
# (k_scale, v_scale) of one layer's FP8 cache: it stores k / k_scale and v / v_scale; (1.0, 1.0) for other caches
KVScale = tuple[float, float]


def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache tensor (see module docstring)."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if int(value) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return (2, int(num_blocks), int(block_size), int(num_kv_heads), int(head_dim))


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Shape checks every backend runs before touching the cache (cheap: no device syncs)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (T, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (T={num_tokens}, Hkv, {head_dim})")
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache must be (2, num_blocks, block_size, {num_kv_heads}, {head_dim}); got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[2] != meta.block_size:
        raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != metadata block_size {meta.block_size}")
    if meta.slot_mapping.shape[0] != num_tokens or meta.num_tokens > num_tokens:
        raise ValueError(
            f"q has {num_tokens} rows but slot_mapping has {meta.slot_mapping.shape[0]} and the requests "
            f"cover {meta.num_tokens} (rows past the last request are padding, with slot -1)"
        )


class AttentionBackend(ABC):
    """One implementation of paged attention (torch reference, Triton, ...)."""

    name: str = "abstract"
    # True when forward reads lengths only from device tensors (no host copies), so a decode step
    # can be captured in a CUDA graph and replayed with other lengths.
    supports_cuda_graph: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale = (1.0, 1.0),
    ) -> torch.Tensor:
        """Write k/v (T, Hkv, D) into ``kv_cache`` at ``meta.slot_mapping``, then return the
        causal attention output (T, Hq, D) of q (T, Hq, D) over each request's cached context,
        in q's dtype. An FP8 cache stores k / k_scale and v / v_scale (``kv_scale``)."""

    # True when ``forward_cached`` exists: attention over a cache whose new rows the caller already wrote
    # (models/fused_ops.rotary_write_kv_ writes them in the rotary kernel, one launch per layer fewer).
    supports_external_kv_write: bool = False

    def forward_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
        """``forward`` without its KV write: the caller has written this step's k/v at
        ``meta.slot_mapping`` already. Only where ``supports_external_kv_write``."""
        raise NotImplementedError(f"the {self.name} backend writes its own KV rows; call forward")

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, out: OutputRows,
                     kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
        """``forward``'s KV write for every row, and the attention output of ``out.rows`` only (S, Hq, D): a
        model's last layer, where only the sampled rows go on. This default attends every row and picks;
        backends that can attend just those rows override it."""
        return self.forward(q, k, v, kv_cache, meta, scale, kv_scale)[out.rows]

    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)


def _auto_backend(device) -> str:
    """"triton" on CUDA when Triton imports, "cpu_sdpa" on the CPU, else the torch reference."""
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if not on_cuda:
        return "cpu_sdpa" if device is None or torch.device(device).type == "cpu" else "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def get_attn_backend(name: str = "torch", device=None) -> AttentionBackend:
    """Backend by name: "torch" (reference), "cpu_sdpa" (CPU), "triton" (GPU kernels), or "auto"
    (triton on CUDA, cpu_sdpa on the CPU; ``device`` is where the model runs, default: CUDA if available)."""
    if name == "auto":
        name = _auto_backend(device)
    if name in ("torch", "torch_ref"):
        from tallyserve.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "cpu_sdpa":
        from tallyserve.attention.cpu_sdpa import CpuSdpaBackend

        return CpuSdpaBackend()
    if name == "triton":
        from tallyserve.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: ['torch', 'cpu_sdpa', 'triton', 'auto']")
