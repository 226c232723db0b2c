"""Host values onto the device without waiting for it: one pinned buffer, one non-blocking copy per step
(the batch builder, the sampler, penalties and the grammar mask all upload through here)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def host_tensor(values: Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small tensor of host values on ``device`` without waiting for the device. A plain
    ``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronizes the stream,
    which would stall async scheduling; this goes through the batch builder's pinned, non-blocking upload."""
    return upload_arrays([np.asarray(values)], dtype, torch.device(device))[0]


def upload_arrays(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Tensors of ``arrays`` (cast to ``dtype``) on ``device``; see ``upload``."""
    return upload([(a, dtype) for a in arrays], device)


def upload(arrays: list[tuple[np.ndarray, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Tensors of ``arrays`` (each cast to its dtype) on ``device``. On CUDA they are packed into one
    pinned host buffer and moved by ONE non-blocking copy (views of it come back); the caching host
    allocator keeps the buffer alive until the copy has run. On the CPU: zero-copy ``from_numpy``."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=torch.empty((), dtype=dtype).numpy().dtype)).to(device)
                for a, dtype in arrays]
    return upload_packed(arrays, device)[0]


def upload_packed(arrays: list[tuple[np.ndarray, torch.dtype]], device: torch.device
                  ) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """``upload`` on CUDA, also returning the packed device buffer (uint8) and each piece's byte offset in it."""
    host, views = pack(arrays, pin_memory=device.type == "cuda")
    dev = host.to(device, non_blocking=True)
    return views(dev), dev, views.offsets


def pack(arrays: list[tuple[np.ndarray, torch.dtype]], pin_memory: bool = False):
    """``arrays`` cast and packed into one uint8 host tensor, each piece 16-byte aligned (like a fresh
    allocation: Triton specialises kernels on pointer alignment, so unaligned views would compile new
    variants as batch sizes change). Returns (buffer, views): ``views(t)`` slices a copy ``t`` of the
    buffer (on any device) back into the typed, shaped tensors."""
    np_dtypes = [torch.empty((), dtype=dtype).numpy().dtype for _, dtype in arrays]
    offsets, total = [], 0
    for (a, _), d in zip(arrays, np_dtypes):
        offsets.append(total)
        total += -(-a.size * d.itemsize // 16) * 16
    host = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=pin_memory)
    flat = host.numpy()
    for (a, _), d, off in zip(arrays, np_dtypes, offsets):
        flat[off:off + a.size * d.itemsize].view(d)[:] = a.reshape(-1)

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[off:off + a.size * d.itemsize].view(dtype).view(a.shape)
                for (a, dtype), d, off in zip(arrays, np_dtypes, offsets)]
    views.offsets = offsets  # byte offset of each piece
    return host, views
