"""`tallyserve profile`: measure the real step time of the engine over a grid and write the profile
JSON that `tallyserve simulate --hardware PROFILE.json` interpolates.

Grid axes (see `sim.cost_model.ProfileCostModel`): `batch_size` requests per step, each with
`context_len` tokens already in the KV cache; every request computes one new token except the
first, which computes `1 + extra_tokens` (a prefill chunk riding with decode rows). A step is
timed from the frozen SchedulerOutput to sampled tokens: batch build, forward pass, sampling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from tallyserve.core.kv_cache_manager import cdiv
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.sampling_params import SamplingParams


def _step_output(batch_size: int, extra: int, context: int, block_size: int, num_blocks: int) -> SchedulerOutput:
    """A synthetic step; block ids wrap around the pool (contents do not matter for timing)."""
    greedy = SamplingParams(temperature=0.0)
    entries, next_block = [], 0
    for i in range(batch_size):
        n = 1 + (extra if i == 0 else 0)
        blocks = []
        for _ in range(cdiv(context + n, block_size)):
            blocks.append(next_block % num_blocks)
            next_block += 1
        entries.append(ScheduledRequest(
            request_id=f"p{i}", token_ids=tuple((7 * i + j) % 97 + 3 for j in range(n)), start_position=context,
            block_ids=tuple(blocks), sample=True, sampling_params=greedy, num_output_tokens=0,
        ))
    total = sum(e.num_tokens for e in entries)
    return SchedulerOutput(step_id=0, requests=tuple(entries), total_tokens=total, max_num_batched_tokens=total)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(engine, so: SchedulerOutput, repeats: int) -> tuple[float, float]:
    """Median seconds of (build + forward + sample, and its host part: build and launch until the
    launch returns) for one SchedulerOutput, after one warm-up, through the engine's own executor:
    the same prepare and launch the engine core runs. With async scheduling the host part of one
    step overlaps the device part of the one before."""
    executor, device = engine.executor, engine.device
    totals, hosts = [], []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        handle = executor.launch(so, executor.prepare(so, None), None)
        t1 = time.perf_counter()
        handle.result()
        _sync(device)
        if i:
            totals.append(time.perf_counter() - t0)
            hosts.append(t1 - t0)
    return statistics.median(totals), statistics.median(hosts)


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def run_profile(engine, batch_sizes: Sequence[int], extra_tokens: Sequence[int], context_lens: Sequence[int],
                repeats: int = 3, progress: bool = True) -> dict:
    for name, axis, lo in (("batch sizes", batch_sizes, 1), ("extra tokens", extra_tokens, 0),
                           ("context lengths", context_lens, 0)):
        if not axis or sorted(set(axis)) != list(axis) or axis[0] < lo:
            raise ValueError(f"{name} must be strictly increasing integers >= {lo}, got {list(axis)}")
    max_len = engine.config.scheduler_config.max_model_len
    if context_lens[-1] + extra_tokens[-1] + 1 > max_len:
        raise ValueError(f"largest context + extra tokens + 1 = {context_lens[-1] + extra_tokens[-1] + 1} "
                         f"exceeds max_model_len {max_len}")
    cc = engine.config.cache_config
    bar = tqdm(total=len(batch_sizes) * len(extra_tokens) * len(context_lens), desc="profile", disable=not progress)
    table, host_table = [], []
    for b in batch_sizes:
        rows, host_rows = [], []
        for e in extra_tokens:
            cells, host_cells = [], []
            for c in context_lens:
                total, host = time_step(engine, _step_output(b, e, c, cc.block_size, cc.num_blocks), repeats)
                cells.append(total)
                host_cells.append(host)
                bar.update(1)
            rows.append(cells)
            host_rows.append(host_cells)
        table.append(rows)
        host_table.append(host_rows)
    bar.close()
    dev = engine.device
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "model": engine.served_model_name,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "block_size": cc.block_size,
        "memory_bytes": _memory_bytes(dev),
        "repeats": repeats,
        "batch_size": list(batch_sizes),
        "extra_tokens": list(extra_tokens),
        "context_len": list(context_lens),
        "step_time_s": table,
        "host_time_s": host_table,
    }


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_profile(ns: argparse.Namespace) -> int:
    from tallyserve.cli import engine_args_from
    from tallyserve.engine.llm_engine import LLMEngine

    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    engine = LLMEngine(engine_args_from(ns))
    profile = run_profile(engine, ns.batch_sizes, ns.extra_tokens, ns.context_lens, ns.repeats,
                          progress=not ns.disable_tqdm)
    with open(ns.output, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {ns.output}: {len(ns.batch_sizes) * len(ns.extra_tokens) * len(ns.context_lens)} points on "
          f"{profile['device']}")
    return 0


def register(sub) -> None:
    from tallyserve.cli import add_engine_args

    p = sub.add_parser("profile", help="measure step times over a grid for `simulate --hardware PROFILE.json`",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 128], help="requests per step")
    p.add_argument("--extra-tokens", type=_ints, default=[0, 128, 512, 2048],
                   help="prefill tokens beyond one per request")
    p.add_argument("--context-lens", type=_ints, default=[0, 1024, 4096], help="KV tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median), after one warm-up")
    p.add_argument("--output", default="profile.json")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=_cmd_profile)
