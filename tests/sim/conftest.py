"""Fixtures of the simulator tests: one tiny random Llama (no tokenizer) per session."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    # One thread: on a small shared CPU, torch's thread pool oversubscribes and runs 50x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield make_tiny_model(tmp_path_factory.mktemp("sim-llama"), "llama", seed=1)
    finally:
        torch.set_num_threads(threads)
