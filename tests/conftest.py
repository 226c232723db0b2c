"""Engines that the CPU tests build with ``device="auto"`` stay on the CPU even on a CUDA machine:
their parity checks with transformers run in float32, while "auto" on CUDA means bf16. Server tests'
subprocesses inherit this too. tests/gpu asks for CUDA explicitly. Export TALLYSERVE_DEVICE=auto to
run the whole suite on the GPU."""

import os

os.environ.setdefault("TALLYSERVE_DEVICE", "cpu")
