"""tests/gpu: the tiny Llama model the CUDA-graph tests build once per module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu, for graph_helpers
from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graph"), "llama")
