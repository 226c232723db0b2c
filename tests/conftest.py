"""Engines that the CPU tests build with ``device="auto"`` stay on the CPU even on a CUDA machine:
their parity checks with transformers run in float32, while "auto" on CUDA means bf16. Server tests'
subprocesses inherit this too. tests/gpu asks for CUDA explicitly. Export TALLYSERVE_DEVICE=auto to
run the whole suite on the GPU."""

import os

os.environ.setdefault("TALLYSERVE_DEVICE", "cpu")

import pytest  # noqa: E402


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if any weight is read: for configurations that must be refused before loading."""
    from tallyserve.models import loader

    def fail(*a, **k):
        raise AssertionError("weights were read before the configuration was refused")

    monkeypatch.setattr(loader, "_load_safetensors", fail)
