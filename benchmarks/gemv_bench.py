"""One-row projections on the GPU: cuBLAS against tallyserve's Triton GEMV (models/gemv.py), with and without
programmatic dependent launch, over a model preset's per-layer weights.

    PYTHONPATH=$PWD python3 benchmarks/gemv_bench.py [--model llama-3-8b] [--layers 32]

Each projection runs once per layer over ``--layers`` distinct weight copies (so nothing is served from L2),
captured in a CUDA graph; the replay time over the bytes read gives TB/s. Also: the card's read bandwidth
(a Triton sum over 4 GiB) and a chain of the MLP and attention projections with add + RMSNorm between them,
as a decode step of one sequence runs them. With $OUT set, the numbers go to $OUT/gemv_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _read_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), 0))


def graph_ms(fn, reps: int = 20) -> float:
    """Median replay time (ms) of ``fn`` captured in a CUDA graph (after one warm-up run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def read_bandwidth(dev: torch.device) -> float:
    """TB/s of a Triton sum over 4 GiB of bf16."""
    big = torch.randn(2 ** 31, device=dev, dtype=torch.bfloat16)
    partial = torch.empty(triton.cdiv(big.numel(), 8192), device=dev)
    ms = graph_ms(lambda: _read_kernel[(partial.numel(),)](big, partial, big.numel(), BLOCK=8192, num_warps=8), reps=10)
    return big.numel() * 2 / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b", help="a preset of tallyserve/model_configs")
    ap.add_argument("--layers", type=int, default=32, help="distinct weight copies per projection")
    args = ap.parse_args()
    from tallyserve.models import fused_ops, gemv

    cfg = json.loads((Path(__file__).resolve().parents[1] / "tallyserve/model_configs" / f"{args.model}.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], args.layers
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_width = cfg["num_attention_heads"] * head_dim
    qkv = q_width + 2 * cfg["num_key_value_heads"] * head_dim
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    results: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "shapes": {}}

    results["read_TBps"] = read_bandwidth(dev)
    print(f"read bandwidth {results['read_TBps']:.2f} TB/s")

    def with_pdl(flag: str, fn):
        old = os.environ.get("TALLYSERVE_PDL")
        os.environ["TALLYSERVE_PDL"] = flag
        try:
            return graph_ms(fn)
        finally:
            os.environ.pop("TALLYSERVE_PDL") if old is None else os.environ.__setitem__("TALLYSERVE_PDL", old)

    shapes = {"qkv_proj": (qkv, hidden, False), "o_proj": (hidden, q_width, False),
              "gate_up_proj": (2 * inter, hidden, False), "down_proj (SiLU-mul input)": (hidden, inter, True)}
    weights = {}
    for name, (n, k, silu) in shapes.items():
        w = [(0.02 * torch.randn(n, k, device=dev)).to(bf16) for _ in range(layers)]
        weights[name] = w
        x = torch.randn(1, 2 * k if silu else k, device=dev, dtype=bf16)
        plain_x = fused_ops.silu_mul(x) if silu else x
        out = torch.empty(1, n, device=dev, dtype=bf16)
        nbytes = n * k * 2 * layers
        runs = {"cublas": graph_ms(lambda: [torch.mm(plain_x, wi.t(), out=out) for wi in w]),
                "triton": with_pdl("0", lambda: [gemv.gemv(x, wi, silu_mul_input=silu) for wi in w]),
                "triton + PDL": with_pdl("1", lambda: [gemv.gemv(x, wi, silu_mul_input=silu) for wi in w])}
        row = {tag: {"us": ms * 1e3 / layers, "TBps": nbytes / ms / 1e9} for tag, ms in runs.items()}
        results["shapes"][name] = {"n": n, "k": k, **row}
        print(f"{name:28s} ({n} x {k}): " + ", ".join(f"{t} {r['us']:.2f} us {r['TBps']:.2f} TB/s" for t, r in row.items()))

    norm_w = torch.ones(hidden, device=dev, dtype=bf16)
    h0 = torch.randn(1, hidden, device=dev, dtype=bf16)
    r0 = torch.randn(1, hidden, device=dev, dtype=bf16)
    wq, wo, wgu, wd = (weights[k] for k in shapes)

    def chain(triton_gemv: bool):
        h, r = h0, r0.clone()
        for i in range(layers):
            x = fused_ops.add_rms_norm(h, r, norm_w, 1e-5)
            if triton_gemv:
                h = gemv.gemv(gemv.gemv(x, wq[i])[:, :q_width].contiguous(), wo[i])
                x = fused_ops.add_rms_norm(h, r, norm_w, 1e-5)
                h = gemv.gemv(gemv.gemv(x, wgu[i]), wd[i], silu_mul_input=True)
            else:
                h = F.linear(F.linear(x, wq[i])[:, :q_width].contiguous(), wo[i])
                x = fused_ops.add_rms_norm(h, r, norm_w, 1e-5)
                h = F.linear(fused_ops.silu_mul(F.linear(x, wgu[i])), wd[i])
        return h

    total = sum(n * k * 2 for n, k, _ in shapes.values()) * layers
    chains = {"cublas": with_pdl("0", lambda: chain(False)), "triton": with_pdl("0", lambda: chain(True)),
              "triton + PDL": with_pdl("1", lambda: chain(True))}
    results["chain"] = {tag: {"ms": ms, "TBps": total / ms / 1e9} for tag, ms in chains.items()}
    print(f"chain of {layers} layers ({total / 1e9:.2f} GB): " +
          ", ".join(f"{t} {r['ms']:.3f} ms {r['TBps']:.2f} TB/s" for t, r in results["chain"].items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
