"""Tensor parallelism over ``torch.distributed``: the process group lives in ``parallel_state``."""

from tallyserve.distributed.parallel_state import (
    all_gather_last_dim,
    all_reduce,
    destroy,
    gather_last_dim,
    get_tp_group,
    init_tensor_parallel,
    is_initialized,
    tp_rank,
    tp_size,
)

__all__ = [
    "all_gather_last_dim",
    "all_reduce",
    "destroy",
    "gather_last_dim",
    "get_tp_group",
    "init_tensor_parallel",
    "is_initialized",
    "tp_rank",
    "tp_size",
]
