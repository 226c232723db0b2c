"""Which FP8 scheme a model's projections use: read from the checkpoint's Hugging Face ``quantization_config`` and
the engine's ``quantization`` argument (vLLM's name), checked before any weight loads.

Supported (vLLM's names):
  * ``quantization="fp8"`` on a bf16/fp16/fp32 checkpoint: weights quantized at load to FP8 e4m3 with one scale
    per output channel; activations quantized per token at run time.
  * Hugging Face ``{"quant_method": "fp8", ...}`` checkpoints: with ``"weight_block_size": [bn, bk]``
    (DeepSeek / Qwen3-*-FP8: ``weight_scale_inv`` per bn x bk block, activations per token-group of bk,
    ``activation_scheme`` "dynamic"), or without it (one ``weight_scale`` per tensor, activations per token, or
    per tensor from ``input_scale`` when ``activation_scheme`` is "static").
  * ``compressed-tensors`` float8 checkpoints (``format`` "float-quantized" or "naive-quantized"): one config
    group whose weights are 8-bit floats with strategy "channel", "tensor" or "block", and input activations
    8-bit floats with strategy "token" (dynamic) or "tensor" (dynamic or static ``input_scale``), or none
    (weight-only: the activations are then quantized per token on the GPU).
Anything else is a ValueError that names the method or field and what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

QUANTIZATION_METHODS = ("fp8",)  # the values of EngineArgs.quantization (None: the checkpoint's own, if any)
SUPPORTED = ("fp8 (quantization='fp8' on an unquantized checkpoint, or a Hugging Face fp8 checkpoint: block-wise "
             "weight_block_size or per-tensor)", "compressed-tensors float8 (channel, tensor or block weight "
             "scales; token or tensor activation scales)")
# the projections a quantized model stores in FP8; embeddings, lm_head and norms stay in the model's dtype
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Config:
    """How the projections' FP8 weights are scaled and their activations quantized.

    ``weight_strategy``: "channel" (one scale per output row), "tensor" (one per matrix) or "block"
    (``block_size`` = (rows, columns) per scale). ``activation``: "token" (dynamic, per row), "group" (dynamic,
    per row and group of ``block_size[1]`` columns: the block format), "tensor" (dynamic, per matrix) or
    "static" (per matrix, the checkpoint's ``input_scale``). ``serialized``: the checkpoint holds FP8 weights
    and their scales (else they are quantized at load). ``scale_name``: the checkpoint's name for the weight
    scales. ``ignored``: module names (or prefixes) left unquantized."""

    weight_strategy: str
    activation: str
    serialized: bool
    block_size: Optional[tuple[int, int]] = None
    scale_name: str = "weight_scale"
    ignored: tuple[str, ...] = ()
    source: str = "fp8"  # the checkpoint's quant_method, or "fp8" for quantization at load

    @property
    def static_input_scale(self) -> bool:
        return self.activation == "static"

    def is_quantized(self, module_name: str) -> bool:
        """Whether the projection ``module_name`` (e.g. "model.layers.0.self_attn.q_proj") is stored in FP8."""
        if module_name.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS:
            return False
        for ignored in self.ignored:
            if ignored.startswith("re:"):
                if re.fullmatch(ignored[3:], module_name):
                    return False
            elif module_name == ignored or module_name.startswith(ignored + "."):
                return False
        return True

    def describe(self) -> str:
        scales = {"channel": "per output channel", "tensor": "per tensor",
                  "block": f"per {self.block_size[0]}x{self.block_size[1]} block" if self.block_size else ""}
        acts = {"token": "per token", "group": f"per token and group of {self.block_size[1] if self.block_size else 0}",
                "tensor": "per tensor", "static": "static per tensor"}
        where = "from the checkpoint" if self.serialized else "quantized at load"
        return (f"FP8 e4m3 weights {where} ({self.source}), scales {scales[self.weight_strategy]}, "
                f"activations {acts[self.activation]}")


def _positive_pair(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"quantization_config {field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _hf_fp8(qc: dict) -> Fp8Config:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config fmt {fmt!r} is not supported: only 'e4m3' FP8 weights")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if scheme != "dynamic":
            raise ValueError("quantization_config: block-wise FP8 (weight_block_size) needs activation_scheme "
                             f"'dynamic', got {scheme!r}")
        return Fp8Config("block", "group", True, _positive_pair(block, "weight_block_size"), "weight_scale_inv",
                         ignored, "fp8")
    return Fp8Config("tensor", "static" if scheme == "static" else "token", True, None, "weight_scale", ignored, "fp8")


def _is_float8(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("num_bits") == 8 and spec.get("type") == "float"


def _compressed_tensors(qc: dict) -> Fp8Config:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized", None):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: supported are float-quantized and "
                         f"naive-quantized float8 checkpoints")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("compressed-tensors: exactly one config group is supported, got "
                         f"{len(groups) if isinstance(groups, dict) else groups!r}")
    (name, group), = groups.items()
    if not isinstance(group, dict):
        raise ValueError(f"compressed-tensors config group {name!r} must be an object")
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise ValueError(f"compressed-tensors config group {name!r} must target 'Linear', got {targets!r}")
    weights, acts = group.get("weights"), group.get("input_activations")
    if not _is_float8(weights):
        raise ValueError(f"compressed-tensors config group {name!r}: only 8-bit float weights are supported, got "
                         f"{weights!r}")
    if weights.get("symmetric") is False:
        raise ValueError("compressed-tensors: asymmetric FP8 weights are not supported")
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors: dynamic weight scales are not supported")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block = _positive_pair(weights.get("block_structure"), "weights.block_structure")
    elif strategy not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported: supported are "
                         "'channel', 'tensor' and 'block'")
    if acts is None:
        activation = "group" if block else "token"
    elif not _is_float8(acts):
        raise ValueError(f"compressed-tensors config group {name!r}: input activations must be 8-bit floats or "
                         f"absent, got {acts!r}")
    else:
        act_strategy, dynamic = acts.get("strategy"), acts.get("dynamic", True)
        if act_strategy == "token" and dynamic:
            activation = "token"
        elif act_strategy == "group" and dynamic and block:
            activation = "group"
        elif act_strategy == "tensor":
            activation = "tensor" if dynamic else "static"
        else:
            raise ValueError(f"compressed-tensors activation strategy {act_strategy!r} (dynamic={dynamic!r}) is not "
                             "supported: supported are dynamic 'token', dynamic or static 'tensor'")
        if block and activation != "group":
            raise ValueError("compressed-tensors: block-wise weights need per-group dynamic activations")
    return Fp8Config(strategy, activation, True, block, "weight_scale", tuple(qc.get("ignore") or ()),
                     "compressed-tensors")


def resolve_quantization(hf_config: dict, quantization: Optional[str]) -> Optional[Fp8Config]:
    """The FP8 scheme of a model whose Hugging Face config is ``hf_config``, served with
    ``EngineArgs.quantization``; None for an unquantized model. ValueError for anything unsupported."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got {quantization!r}")
    qc = hf_config.get("quantization_config")
    if qc is None:
        if quantization == "fp8":
            return Fp8Config("channel", "token", False)
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"quantization method {method!r} in the checkpoint's quantization_config is not supported; "
                     f"supported: {'; '.join(SUPPORTED)}")
