"""One compiled call for all decoder layers of a CPU step (``tallyserve_cpu::decode_layers``).

When every request of a step reads its K/V in place through the compiled attention kernel (decode rows, short
chunks: ``cpu_sdpa.compiled_decode_plan``) and the model has fused projections without biases or q/k norm, the
layers run in C++: add + RMSNorm, the q/k/v product, RoPE, the KV write, attention, the output product, add +
RMSNorm, gate/up, SiLU-and-multiply and down, then the final norm. They are the same ATen and tallyserve operators
in the same order as ``LlamaModel._forward_fused`` on the CPU, so outputs and cache are bit-identical; what goes is
the Python around ~13 operators per layer (about 4 ms of a 25 ms single-sequence step of the bundled model).
Float32 projections take steps of up to ``CPU_MLP_CHUNK_ROWS`` rows (which the Python MLP runs whole); bfloat16
projections (dtype="bfloat16") up to ``CPU_MLP_CHUNK_ROWS_BF16``, each product as ``layers.linear`` makes it:
``gemv_bf16`` for one to four rows, oneDNN's matmul on the blocked weights (``pack_cpu_weight``) from five; float32
projections on oneDNN's blocked weights at every row count where the model packed them (``onednn_float32_pays``),
or on the AVX2 kernel's panels (``sgemm_float32_pays``; every projection's output features a multiple of 16).
``TALLYSERVE_CPU_DECODE_LAYERS=0`` keeps the Python layers.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from tallyserve import envs
from tallyserve.kernels import cpu_kernels
from tallyserve.attention.backend import check_attention_inputs
from tallyserve.attention.metadata import AttentionMetadata
from tallyserve.models import cpu_products, layers
from tallyserve.attention.cpu_sdpa import compiled_decode_plan
from tallyserve.attention.cpu_sdpa import CpuSdpaBackend


# layer_weights' verdict per model (checked once per model)
_LAYER_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layer_weights(model) -> Optional[tuple[bool, list, Optional[list]]]:
    """(bfloat16 projections?, the per-layer weights the operator takes, the same with the projections' blocked
    copies from ``cpu_products.pack_cpu_weight`` where every projection has one, else None) when ``model`` (a
    LlamaModel) fits it: fused float32 or bfloat16 projections without biases or q/k norm, one process (no tensor
    parallelism), the compiled CPU attention backend; else None, and None under TALLYSERVE_CPU_DECODE_LAYERS=0. The
    model's fit is checked once per model."""
    if not envs.TALLYSERVE_CPU_DECODE_LAYERS:
        return None
    cached = _LAYER_WEIGHTS.get(model, False)
    if cached is not False:
        return cached

    mm = model.matmul_dtype
    wdtype = torch.float32 if mm is None else mm
    act = None if mm is None else torch.float32  # dtype="bfloat16": q/k/v come back in the model's float32
    scale = model.layers[0].self_attn.scale

    def fits(layer) -> bool:
        a, m = layer.self_attn, layer.mlp
        if not isinstance(m, layers.GatedMLP):  # a mixture of experts runs in Python
            return False
        weights = (a.qkv_weight, a.o_proj.weight, m.gate_up_weight, m.down_proj.weight)
        return (all(w is not None and w.dtype == wdtype and w.is_contiguous() for w in weights)
                and a.qkv_bias is None and not a.qk_norm and a.act_dtype == act and a.o_proj.bias is None
                and a.o_proj.tp_size == 1 and isinstance(a.attn_backend, CpuSdpaBackend) and a.scale == scale
                and m.gate_proj.bias is None and m.down_proj.bias is None and m.down_proj.tp_size == 1
                and layer.input_layernorm.eps == layer.post_attention_layernorm.eps == model.norm.eps)
    bf16 = mm == torch.bfloat16
    fit = None
    if ((mm is None or (bf16 and hasattr(torch.ops.tallyserve_cpu, "gemv_bf16")))
            and model.norm.weight.device.type == "cpu" and model.norm.weight.dtype == torch.float32
            and all(fits(layer) for layer in model.layers)
            and cpu_kernels.load() and hasattr(torch.ops.tallyserve_cpu, "decode_layers")):
        plain = [[layer.input_layernorm.weight for layer in model.layers],
                 [layer.self_attn.qkv_weight for layer in model.layers],
                 [layer.self_attn.o_proj.weight for layer in model.layers],
                 [layer.post_attention_layernorm.weight for layer in model.layers],
                 [layer.mlp.gate_up_weight for layer in model.layers],
                 [layer.mlp.down_proj.weight for layer in model.layers]]
        blocked = None
        for attr in ("mkldnn_packed", "sgemm_packed"):
            if all(getattr(w, attr, None) is not None and (attr == "mkldnn_packed" or w.shape[0] % 16 == 0)
                   for i in (1, 2, 4, 5) for w in plain[i]):
                blocked = [[getattr(w, attr, w) for w in ws] for ws in plain]
        fit = (bf16, plain, blocked)
    _LAYER_WEIGHTS[model] = fit
    return fit


def decode_layers(model, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[torch.Tensor],
                  attn_meta: AttentionMetadata) -> Optional[torch.Tensor]:
    """The final-norm hidden states of the step from one compiled call, when the model fits it and every request
    goes through the compiled attention kernel in place; else None (the caller runs the Python layers)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    fit = layer_weights(model)
    if fit is None:
        return None
    bf16, weights, blocked = fit
    rows = x.shape[0]
    if not bf16:  # float32: oneDNN's blocked weights (3) or the AVX2 kernel's panels (4) where the model packed them
        projections, weights = (0, weights) if blocked is None else \
            (4 if getattr(weights[1][0], "sgemm_packed", None) is not None else 3, blocked)
    elif rows <= cpu_products.CPU_GEMV_MAX_ROWS:
        projections = 1
    else:  # the rows layers.linear multiplies with oneDNN on the blocked weights, the MLP whole
        projections, weights = 2, blocked
    if weights is None or rows > (layers.CPU_MLP_CHUNK_ROWS_BF16 if bf16 else layers.CPU_MLP_CHUNK_ROWS):
        return None

    attn = model.layers[0].self_attn
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    first = kv_caches[0]
    plan = compiled_decode_plan(attn_meta, d, first.dtype)
    if plan is None:
        return None
    # the backend's checks, on one cache (the others must match it) instead of per layer
    t = x.shape[0]
    check_attention_inputs(torch.empty((t, hq, d), device="meta"), *[torch.empty((t, hkv, d), device="meta")] * 2,
                           first, attn_meta)
    if any(c.shape != first.shape or c.dtype != first.dtype or not c.is_contiguous() for c in kv_caches):
        raise ValueError("every layer's KV cache must be contiguous, with the first one's shape and dtype")
    cos, sin = rope
    if (cos.shape != (t, d) or sin.shape != cos.shape or sin.stride() != cos.stride() or cos.stride(1) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        raise ValueError(f"cos/sin must be float32 ({t}, {d}), the same strides, the last 1; got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    # what the operator's TORCH_CHECKs would refuse, as ValueError here (cpu_kernels: errors from the kernels are
    # unsafe on some hosts): block ids and seq_lens against the cache, the slots
    plan.validate(first, t)
    cpu_kernels.check_slots(attn_meta.slot_mapping, t, first)
    return torch.ops.tallyserve_cpu.decode_layers(
        x.contiguous(), *weights, model.norm.weight, model.norm.eps, hq, hkv, d, cos, sin, kv_caches,
        attn_meta.slot_mapping, plan.tables, plan.qsl, plan.lens, attn.scale, projections)
