"""Decode attention on the GPU: KernelConfig variants over a cache laid out as the engine lays it out.

    python3 benchmarks/decode_attention_bench.py [--batch 256 --batch 64] [--rounds 3] [--out FILE]
        [--variant NAME:key=value,key=value ...]

The cache of each batch mirrors the mixed workload of ``h200_bench.py`` (Llama-3-8B attention shapes:
32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16): each request has a prompt of 256-1024
tokens in consecutive blocks (a prefill allocates them together) and 0-256 decoded tokens in blocks
handed out one at a time to the requests in turn (decode steps of the whole batch), so its table is a
run of blocks and then blocks strided by the batch. ``--layout shuffled`` draws every block at random.

Each variant runs 20 calls captured in one CUDA graph (no launch gaps, as a decode step runs), the
median of 5 replays; variants are interleaved over ``--rounds`` rounds and the best round counts. The
figure is KV bytes read per second (every request's K and V, all heads) against a device-to-device
copy of 2 GiB measured in the same process. Outputs of every variant are compared with the default's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from h200_checks import _graph_ms  # noqa: E402  (calls captured in one CUDA graph, median of replays)

DEFAULT_VARIANTS = [
    "default:",
    "heads_first:decode_heads_first=1",
    "heads_first_st2:decode_heads_first=1,decode_num_stages=2",
    "heads_first_st4:decode_heads_first=1,decode_num_stages=4",
    "heads_first_n128_st2:decode_heads_first=1,decode_block_n=128,decode_num_stages=2",
    "heads_first_n32_st4:decode_heads_first=1,decode_block_n=32,decode_num_stages=4",
    "heads_first_w8:decode_heads_first=1,decode_num_warps=8",
    "heads_first_split2:decode_heads_first=1,num_splits=2",
    "st4:decode_num_stages=4",
    "split2:num_splits=2",
]


def parse_variant(text: str):
    from tallyserve.attention.triton_attn import KernelConfig

    name, _, body = text.partition(":")
    kwargs = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        field = {f.name: f for f in dataclasses.fields(KernelConfig)}.get(key)
        if field is None:
            raise SystemExit(f"--variant {text!r}: KernelConfig has no field {key!r}")
        kwargs[key] = value not in ("0", "false", "False") if "bool" in str(field.type) else int(value)
    return name, KernelConfig(**kwargs)


def build_case(batch: int, layout: str, seed: int, hq=32, hkv=8, dim=128, bs=16):
    from tallyserve.attention.backend import get_kv_cache_shape
    from tallyserve.attention.metadata import AttentionMetadata

    dev = torch.device("cuda")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(256, 1025, batch)
    decoded = rng.integers(0, 257, batch)
    lens = (prompts + decoded).tolist()
    blocks_of = [-(-n // bs) for n in lens]
    prompt_blocks = [-(-int(p) // bs) for p in prompts]
    num_blocks = sum(blocks_of) + 8
    tables = [[] for _ in range(batch)]
    if layout == "shuffled":
        free = rng.permutation(num_blocks).tolist()
        for i in range(batch):
            tables[i] = [free.pop() for _ in range(blocks_of[i])]
    else:
        nxt = 0
        for i in range(batch):  # the prompts: a run of blocks each
            tables[i] = list(range(nxt, nxt + prompt_blocks[i]))
            nxt += prompt_blocks[i]
        while any(len(tables[i]) < blocks_of[i] for i in range(batch)):  # decode: one block per request in turn
            for i in range(batch):
                if len(tables[i]) < blocks_of[i]:
                    tables[i].append(nxt)
                    nxt += 1
    cache = torch.randn(get_kv_cache_shape(num_blocks, bs, hkv, dim), dtype=torch.bfloat16, device=dev)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        query_start_loc_cpu=tuple(range(batch + 1)), seq_lens_cpu=tuple(lens), block_size=bs,
        max_query_len=1, max_seq_len=max(lens),
    )
    q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device=dev)
    kv_bytes = sum(lens) * hkv * dim * 2 * 2
    return q, cache, meta, kv_bytes


def copy_tbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = _graph_ms(lambda: dst.copy_(src), calls=5)
    return 2 * src.numel() * 2 / ms / 1e9  # read + write


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--layout", choices=("engine", "shuffled"), default="engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="NAME:field=value,... of KernelConfig")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from tallyserve.attention.triton_attn import paged_attention

    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    copy = copy_tbps()
    print(f"device copy: {copy:.2f} TB/s (read + write)")
    report = {"copy_tbps": round(copy, 3), "layout": args.layout, "batches": {}}
    for batch in args.batch or [256, 64]:
        q, cache, meta, kv_bytes = build_case(batch, args.layout, seed=batch)
        outs, best = {}, {}
        for _ in range(args.rounds):
            for name, cfg in variants:
                out = torch.empty_like(q)
                ms = _graph_ms(lambda: paged_attention(q, cache, meta, 0.088, out=out, config=cfg))
                best[name] = min(best.get(name, float("inf")), ms)
                outs[name] = out
        ref = outs[variants[0][0]].float()
        rows = []
        for name, cfg in variants:
            err = float((outs[name].float() - ref).abs().max())
            rows.append({"variant": name, "ms": round(best[name], 4), "TB/s": round(kv_bytes / best[name] / 1e9, 3),
                         "max_abs_diff_vs_first": err})
            print(f"batch {batch:4d} {name:24s} {best[name]:.4f} ms  {kv_bytes / best[name] / 1e9:.3f} TB/s  "
                  f"diff {err:.2e}")
        report["batches"][str(batch)] = {"kv_gb": round(kv_bytes / 1e9, 3), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
