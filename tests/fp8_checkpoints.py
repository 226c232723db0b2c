"""Test helper: FP8 checkpoints written from a tiny random float32 model, in the formats users download, each with
its dequantized twin (the same config without ``quantization_config``, float32 weights = FP8 value x scale): the
reference an FP8 load must equal.

The quantization here is written independently of tallyserve's (plain torch, the formats' own definitions):
  * "hf-block": Hugging Face ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3 / Qwen3-*-FP8):
    ``weight_scale_inv`` (ceil(N / bn), ceil(K / bk)), w = fp8 * scale_inv per block;
  * "hf-tensor": ``quant_method: fp8`` without blocks: one ``weight_scale`` per tensor (0-d), dynamic activations;
  * "hf-static": as hf-tensor with ``activation_scheme: static`` and an ``input_scale`` per projection;
  * "ct-channel" / "ct-tensor" / "ct-block": compressed-tensors float-quantized, ``weight_scale`` (N, 1) / (1,) /
    (ceil(N / bn), ceil(K / bk)), dynamic per-token (per-group for blocks) activations;
  * "ct-static": compressed-tensors per-tensor weights with static per-tensor activations (``input_scale``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("hf-block", "hf-tensor", "hf-static", "ct-channel", "ct-tensor", "ct-block", "ct-static")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def _quantize(w: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    return (w / scale_full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _searched_channel_scales(w: torch.Tensor) -> torch.Tensor:
    """Per row, the scale ratio x amax / 448 (ratios CLIP_RATIOS, the first on ties) whose e4m3 values reconstruct
    the row with the least squared error: how quantization="fp8" picks its scales."""
    amax = w.abs().amax(dim=1)
    best_scale = best_err = None
    for r in CLIP_RATIOS:
        s = (amax * r / E4M3_MAX).clamp(min=1e-12)
        err = (_quantize(w, s[:, None]).float() * s[:, None] - w).square().sum(dim=1)
        if best_scale is None:
            best_scale, best_err = s, err
        else:
            better = err < best_err
            best_scale, best_err = torch.where(better, s, best_scale), torch.where(better, err, best_err)
    return best_scale[:, None]


def quantize_tensor(w: torch.Tensor, fmt: str, block: tuple[int, int],
                    search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale as the format stores it) of a float32 (N, K) weight; ``search``: per-channel scales
    chosen by ``_searched_channel_scales``."""
    n, k = w.shape
    if fmt.endswith("block"):
        bn, bk = block
        scale = torch.empty(-(-n // bn), -(-k // bk))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                scale[i, j] = max(tile.abs().max().item() / E4M3_MAX, 1e-12)
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return _quantize(w, full), scale
    if fmt == "ct-channel":
        scale = _searched_channel_scales(w) if search else (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(
            min=1e-12)  # (N, 1)
        return _quantize(w, scale), scale
    scale = torch.tensor(max(w.abs().max().item() / E4M3_MAX, 1e-12))
    return _quantize(w, scale), (scale if fmt.startswith("hf") else scale.reshape(1))


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    if fmt.endswith("block"):
        bn, bk = block
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * scale


def quantization_config(fmt: str, block: tuple[int, int]) -> dict:
    if fmt == "hf-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    if fmt in ("hf-tensor", "hf-static"):
        return {"quant_method": "fp8", "activation_scheme": "static" if fmt == "hf-static" else "dynamic"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": {"ct-channel": "channel", "ct-block": "block"}.get(fmt, "tensor")}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    if fmt == "ct-block":
        weights["block_structure"] = list(block)
        acts = {**acts, "strategy": "group", "group_size": block[1]}
    if fmt == "ct-static":
        acts = {**acts, "strategy": "tensor", "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def write_fp8(src: str, out: str, fmt: str, block: tuple[int, int] = (16, 16), shards: int = 1,
              search: bool = False) -> tuple[str, str]:
    """(FP8 checkpoint directory, its dequantized float32 twin) made from ``src`` (a ``make_tiny_model`` dir);
    ``search``: per-channel scales as quantization="fp8" picks them (ct-channel only)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}")
    src, out = Path(src), Path(out)
    tag = fmt + ("-searched" if search else "")
    fp8_dir, ref_dir = out / f"fp8-{tag}", out / f"ref-{tag}"
    for d in (fp8_dir, ref_dir):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json", "config.json"):
                shutil.copy(f, d / f.name)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    fp8_state, ref_state = {}, {}
    gen = torch.Generator().manual_seed(7)
    for name, w in state.items():
        if not _is_projection(name):
            fp8_state[name] = ref_state[name] = w
            continue
        q, scale = quantize_tensor(w.float(), fmt, block, search)
        prefix = name[: -len(".weight")]
        fp8_state[name] = q
        fp8_state[f"{prefix}.{'weight_scale_inv' if fmt == 'hf-block' else 'weight_scale'}"] = scale
        if fmt.endswith("static"):
            fp8_state[f"{prefix}.input_scale"] = (0.02 + 0.01 * torch.rand((), generator=gen)).reshape(
                () if fmt.startswith("hf") else (1,))
        ref_state[name] = dequantize(q, scale, fmt, block)
    config = json.loads((src / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(config, indent=1))
    config["quantization_config"] = quantization_config(fmt, block)
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file(ref_state, str(ref_dir / "model.safetensors"))
    if shards == 1:
        save_file(fp8_state, str(fp8_dir / "model.safetensors"))
    else:  # tensors dealt round-robin over the shards, so a projection's weight and scale land in different files
        names = sorted(fp8_state)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: fp8_state[n].contiguous() for n in names[i::shards]}
            save_file(part, str(fp8_dir / file))
            weight_map.update({n: file for n in part})
        (fp8_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return os.fspath(fp8_dir), os.fspath(ref_dir)
