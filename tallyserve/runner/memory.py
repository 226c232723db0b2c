"""This process's share of a GPU, for sizing the KV pool when other processes use the same card.

``gpu_memory_utilization`` is the fraction of the card this engine may take (as in vLLM: two engines
at 0.45 each share one GPU). What other processes hold is not ours to count: the baseline is the
free memory seen right after this process's CUDA context exists and before its weights load, and this
process's use is how much free memory it has consumed since. The pool is also never sized past the
memory that is actually free.
"""

from __future__ import annotations

import torch

_BASELINE_FREE: dict[int, int] = {}


def record_memory_baseline(device: torch.device) -> None:
    """Call once before loading weights on ``device`` (creates the CUDA context first)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.zeros(1, device=device)  # the context's own memory is part of the baseline
    free, _ = torch.cuda.mem_get_info(index)
    _BASELINE_FREE[index] = free


def kv_budget_bytes(device: torch.device, utilization: float, activations: int) -> int:
    """Bytes left for the KV pool: this process's share of the card minus what it already uses and the
    activations it needs, capped by the memory free right now (less the activations)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    baseline = _BASELINE_FREE.get(index)
    used = total - free if baseline is None else max(baseline - free, 0)
    return min(int(total * utilization) - used, free) - activations
