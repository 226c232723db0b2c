"""The tensor-parallel process group and the three collectives the model needs.

State: this module holds exactly one thing, the tensor-parallel group (``_TP``), set by
``init_tensor_parallel`` and cleared by ``destroy``. One process per rank; the group is the
default (WORLD) group of ``torch.distributed`` with ``world_size == tp_size``. Before
``init_tensor_parallel`` (and after ``destroy``) ``tp_size()`` is 1, ``tp_rank()`` is 0 and every
collective is a no-op, so single-process code never has to branch on it.

Backends: "nccl" for CUDA tensors, "gloo" for CPU tensors. With NCCL, call
``torch.cuda.set_device`` (or pass ``device``) before the first collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TPGroup:
    size: int
    rank: int
    backend: str
    group: object  # the torch.distributed ProcessGroup (WORLD)


_TP: Optional[_TPGroup] = None


def default_backend(device: torch.device | str | None = None) -> str:
    """"nccl" when the model runs on CUDA (``device``, or CUDA available when not given), else "gloo"."""
    if device is not None:
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_tensor_parallel(
    tp_size: int,
    tp_rank: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 60.0,
    device: torch.device | str | None = None,
) -> None:
    """Join the tensor-parallel group as rank ``tp_rank`` of ``tp_size`` (blocks until every rank
    has joined or ``timeout_s`` passes). ``init_method``: "file:///path" or "tcp://host:port".
    ``device``: where this rank's tensors live (picks the backend; with CUDA it becomes the
    current device). Raises ValueError for bad arguments, RuntimeError if already initialized."""
    global _TP
    if _TP is not None:
        raise RuntimeError(f"tensor parallelism is already initialized (size {_TP.size}, rank {_TP.rank})")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    backend = backend or default_backend(device)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized outside tallyserve.distributed")
    dist.init_process_group(backend=backend, init_method=init_method, world_size=tp_size, rank=tp_rank,
                            timeout=timedelta(seconds=timeout_s))
    _TP = _TPGroup(size=tp_size, rank=tp_rank, backend=backend, group=dist.group.WORLD)


def is_initialized() -> bool:
    return _TP is not None


def tp_size() -> int:
    """Ranks in the tensor-parallel group; 1 when not initialized."""
    return _TP.size if _TP is not None else 1


def tp_rank() -> int:
    """This process's rank in the group; 0 when not initialized."""
    return _TP.rank if _TP is not None else 0


def get_tp_group():
    """The ProcessGroup (for the engine's own broadcasts); None when not initialized."""
    return _TP.group if _TP is not None else None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group, in place; returns ``x``. No-op at size 1."""
    if _TP is None or _TP.size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along the last dim, rank order;
    the result is on every rank. Returns ``x`` itself at size 1."""
    if _TP is None or _TP.size == 1:
        return x
    x = x.contiguous()
    if x.dim() == 0:
        raise ValueError("all_gather_last_dim needs a tensor with at least one dimension")
    out = x.new_empty((_TP.size * x.shape[0], *x.shape[1:]))  # ranks stacked along dim 0
    dist.all_gather_into_tensor(out, x, group=_TP.group)
    return torch.cat(out.view(_TP.size, *x.shape).unbind(0), dim=-1)


def gather_last_dim(x: torch.Tensor, dst: int = 0) -> Optional[torch.Tensor]:
    """Like ``all_gather_last_dim`` but only rank ``dst`` receives the result; the other ranks get
    None. Returns ``x`` itself at size 1."""
    if _TP is None or _TP.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.size)] if _TP.rank == dst else None
    dist.gather(x, parts, dst=dst, group=_TP.group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def destroy() -> None:
    """Leave and destroy the group (idempotent)."""
    global _TP
    if _TP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP = None
