"""What the CUDA-graph tests share (test_cuda_graph.py, the CPU part with a fake graph factory, and
test_cuda_graph_gpu.py, real graphs): the tiny model and its loader, and a forward batch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tallyserve.models.loader import load_model, resolve_model


def make_batch(ids, positions, meta):
    return SimpleNamespace(input_ids=ids, positions=positions, attn_meta=meta, num_tokens=int(ids.shape[0]))


def load_tiny(path, backend, device="cpu", dtype=torch.float32):
    return load_model(resolve_model(path, "auto"), "auto", dtype, torch.device(device), 0, backend)
