"""Running Triton kernels on the CPU under Triton's interpreter, for the unit tests.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so setting it inside the pytest process would
depend on import order and leak into other tests: each test module runs its cases in one subprocess instead,
which prints one ``<tag> <json>`` line of results. Triton 3.6's interpreter cannot run runtime-bound loops under
NumPy 2 (fixed in 3.7; the compiled kernels are covered by tests/gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def interpreter_too_old(triton) -> bool:
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)


def run_interpreted(args: list[str], tag: str = "RESULT", timeout: float = 300) -> dict:
    """``python <args>`` from the repo root with TRITON_INTERPRET=1; the JSON of its last ``<tag> `` line."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
    assert proc.returncode == 0 and lines, \
        f"worker failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len(tag) + 1:])
