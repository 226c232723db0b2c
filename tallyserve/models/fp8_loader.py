"""Loading the FP8 projections (``layers._ProjectionLinear`` with ``fp8`` set) from a checkpoint.

Two cases, by the scheme's ``serialized``:
  * an FP8 checkpoint: the e4m3 weight is copied as it is (this rank's slice), its scales read from the
    checkpoint's name (``weight_scale_inv`` for Hugging Face block-wise FP8, ``weight_scale`` otherwise) and brought
    to the layer's layout: one float32 per output row ((N,): a per-tensor scale repeated, a (N, 1) per-channel one
    flattened) or one per block; tensor parallelism slices row scales with the rows they scale and block scales by
    whole blocks. ``input_scale`` (a static activation scale) is one number on every rank.
  * ``quantization="fp8"`` on an unquantized checkpoint: the whole tensor is quantized per output row (each row's
    scale the clipping of its absolute maximum that reconstructs it best, ``quantize_weight(search=True)``), then
    sliced, so every rank holds exactly the tensor-parallel size 1 values of its slice.
Afterwards ``finish`` turns the FP8 projections back into plain weights of the model's dtype on a device that has
no FP8 products (the CPU), with one log line saying so.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from tallyserve.config.quantization import Fp8Config
from tallyserve.kernels import fp8_gemm
from tallyserve.models.layers import ShardSpec
from tallyserve.quantization.fp8 import quantize_weight

logger = logging.getLogger(__name__)

# scales of an FP8 KV cache (kv_cache_dtype="fp8"), which some FP8 checkpoints carry on the attention modules
KV_SCALE_LEAVES = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")


def fp8_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> projection, for the projections that hold FP8 weights."""
    return {name: m for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}


def check_layout(model: nn.Module, quant: Fp8Config) -> None:
    """ValueError before any weight loads when block scales do not fit the model: every fused projection's rows
    and every tensor-parallel slice must be whole blocks."""
    if quant.block_size is None:
        return
    bn, bk = quant.block_size
    for name, layer in fp8_layers(model).items():
        spec = layer.shard_specs().get("weight")
        if spec is not None:
            step = bn if spec.dim == 0 else bk
            if spec.start % step or (spec.size % step and spec.start + spec.size != spec.full_size):
                raise ValueError(f"weight_block_size [{bn}, {bk}] does not fit tensor parallelism: {name}'s slice "
                                 f"[{spec.start}, {spec.start + spec.size}) of dim {spec.dim} is not whole blocks")
        n = layer.weight.shape[0]
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "gate_proj") and n % bn:
            raise ValueError(f"weight_block_size [{bn}, {bk}] does not fit {name}: its {n} output rows (on this "
                             f"rank) are not whole blocks of {bn}, so it cannot be stacked with its neighbours")


def _read(f, name: str, spec: Optional[ShardSpec], want: tuple[int, ...], file: str) -> torch.Tensor:
    """Checkpoint tensor ``name`` (full shape ``want``), or only its slice ``spec``."""
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if shape != want:
        raise ValueError(f"{name}: checkpoint shape {shape} != model shape {want} ({file})")
    if spec is None:
        return f.get_tensor(name)
    index = [slice(None)] * len(shape)
    index[spec.dim] = slice(spec.start, spec.start + spec.size)
    return sl[tuple(index)]


def _block_spec(spec: Optional[ShardSpec], block: int) -> Optional[ShardSpec]:
    if spec is None:
        return None
    return ShardSpec(spec.dim, spec.start // block, -(-spec.size // block), -(-spec.full_size // block))


def load_tensor(layer: nn.Module, module_name: str, leaf: str, f, file: str, quant: Fp8Config) -> list[str]:
    """Load checkpoint tensor ``<module_name>.<leaf>`` of an FP8 projection; returns the parameters it filled.
    ValueError for a tensor of the wrong kind (a full-precision weight in an FP8 checkpoint, an unknown scale)."""
    name = f"{module_name}.{leaf}"
    spec = layer.shard_specs().get("weight")
    n, k = layer.weight.shape
    full = (spec.full_size, k) if spec is not None and spec.dim == 0 else (n, spec.full_size) if spec else (n, k)
    block = quant.block_size
    with torch.no_grad():
        if leaf == "weight":
            dtype = f.get_slice(name).get_dtype()
            if dtype == "F8_E4M3":
                layer.weight.copy_(_read(f, name, spec, full, file))
                return [name]
            if quant.serialized:
                raise ValueError(f"{name} is {dtype} in a checkpoint whose quantization_config says FP8 ({file})")
            weight, scale = quantize_weight(_read(f, name, None, full, file).to(layer.weight.device), block,
                                            search=block is None)
            if spec is not None:
                weight = weight.narrow(spec.dim, spec.start, spec.size)
                if spec.dim == 0:
                    scale = scale.narrow(0, spec.start, spec.size)
            layer.weight.copy_(weight)
            layer.weight_scale.copy_(scale)
            return [name, f"{module_name}.weight_scale"]
        if leaf == "input_scale" and quant.static_input_scale:
            value = f.get_tensor(name)
            if value.numel() != 1:
                raise ValueError(f"{name}: a static input scale is one number, got shape {tuple(value.shape)}")
            layer.input_scale.fill_(value.float().item())
            return [name]
        if leaf != quant.scale_name:
            raise ValueError(f"{name}: unexpected tensor for an FP8 projection whose weight scales are named "
                             f"{quant.scale_name!r} ({file})")
        if block is not None:
            want = (-(-full[0] // block[0]), -(-full[1] // block[1]))
            spec_b = _block_spec(spec, block[0] if spec is not None and spec.dim == 0 else block[1])
            layer.weight_scale.copy_(_read(f, name, spec_b, want, file).float())
            return [f"{module_name}.weight_scale"]
        value = f.get_tensor(name).float()
        if value.numel() == 1:  # per tensor: every row gets it
            layer.weight_scale.fill_(value.item())
        elif value.numel() == full[0]:
            rows = value.reshape(-1)
            if spec is not None and spec.dim == 0:
                rows = rows.narrow(0, spec.start, spec.size)
            layer.weight_scale.copy_(rows)
        else:
            raise ValueError(f"{name}: {tuple(value.shape)} is neither one scale nor one per output row "
                             f"({full[0]}) ({file})")
        return [f"{module_name}.weight_scale"]


def load_kv_scale(model: nn.Module, module_name: str, leaf: str, value: torch.Tensor, file: str) -> None:
    """An FP8 KV cache's scale (``k_scale``, ``v_scale``, or ``kv_scale`` for both) into its attention module's
    ``kv_scale``; the checkpoint's other attention scales (``q_scale``, ``prob_scale``) are not used."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if leaf not in ("k_scale", "v_scale", "kv_scale") or not hasattr(module, "kv_scale"):
        return
    if value.numel() != 1 or not torch.isfinite(value).all() or float(value.reshape(-1)[0]) <= 0:
        raise ValueError(f"{module_name}.{leaf}: a KV cache scale is one positive number, got {value!r} ({file})")
    x = float(value.reshape(-1)[0])
    k, v = module.kv_scale
    module.kv_scale = (x if leaf != "v_scale" else k, x if leaf != "k_scale" else v)


def init_dummy(layer: nn.Module, full: torch.Tensor, spec: Optional[ShardSpec]) -> None:
    """Random weights of an FP8 projection (``load_format="dummy"``): ``full`` drawn at the checkpoint shape like an
    unquantized weight, quantized per row (or per block), then this rank's slice; a static input scale of 1."""
    weight, scale = quantize_weight(full, layer.fp8[0])
    if spec is not None:
        weight = weight.narrow(spec.dim, spec.start, spec.size)
        if layer.fp8[0] is not None:
            b = layer.fp8[0][0] if spec.dim == 0 else layer.fp8[0][1]
            scale = scale.narrow(spec.dim, spec.start // b, -(-spec.size // b))
        elif spec.dim == 0:
            scale = scale.narrow(0, spec.start, spec.size)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(scale)
        if layer.fp8[1] == "static":
            layer.input_scale.fill_(1.0)


def finish(model: nn.Module, quant: Fp8Config, device: torch.device, dtype: torch.dtype) -> None:
    """After loading: on a device without FP8 products, every FP8 projection becomes a plain ``dtype`` weight
    (what its FP8 values and scales stand for)."""
    layers = fp8_layers(model)
    if not layers or (device.type == "cuda" and fp8_gemm.supported(device)):
        if layers:
            logger.info("%s; FP8 products on %s", quant.describe(), device)
        return
    for layer in layers.values():
        layer.dequantize_fp8(dtype)
    if quant.serialized:
        logger.info("%s: %s has no FP8 products, so the weights are dequantized once into %s", quant.describe(),
                    device, str(dtype).removeprefix("torch."))
    else:
        logger.info("quantization='fp8' on %s: weights rounded to FP8 e4m3 (one scale per output channel) and "
                    "kept dequantized in %s, so the answers are FP8's; this device has no FP8 products, so nothing "
                    "runs faster or takes less memory", device, str(dtype).removeprefix("torch."))


def is_fp8_tensor(f, name: str) -> bool:
    return f.get_slice(name).get_dtype() == "F8_E4M3"

