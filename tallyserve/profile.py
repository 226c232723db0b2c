"""`tallyserve profile`: measure the real step time of the engine over a grid and write the profile
JSON that `tallyserve simulate --hardware PROFILE.json` interpolates.

Grid axes (see `sim.profile_cost.ProfileCostModel`): `batch_size` requests per step, each with
`context_len` tokens already in the KV cache; every request computes one new token except the
first, which computes `1 + extra_tokens` (a prefill chunk riding with decode rows). A step is
timed from the frozen SchedulerOutput to sampled tokens: batch build, forward pass, sampling.
Per grid point the profile holds:
- `step_time_s`: the step on its own (host, then device: what a step launched with nothing in
  flight costs), and `host_time_s`, its host part (build and launch until the launch returns);
- `stream_time_s`: the step's period when launched back to back as the engine's async loop
  launches its steps (step N+1 built and launched before step N's results are read), so the host
  part of one step runs while the device computes the one before.
And once, `prefill_pair_time_s`: seconds per causal query-key pair of prefill attention, from
steps of the grid's largest chunk split over 1, 2, 4 and 8 requests (the same tokens, fewer pairs;
the least-squares slope of time over pairs). The grid's extra tokens are one request's chunk, so
this is what prices a step of the same size split over several prompts.
Also, for pure decode steps (see `sim.profile_cost.ProfileCostModel`):
- `cuda_graph_batch_sizes`: the engine's CUDA-graph capture sizes (empty when it runs eagerly): a
  decode step replays the smallest one that holds it, padding rows included;
- `decode_spread`: per batch size (> 1) and context (> 0) of the grid, a decode step whose lengths
  are spread evenly over context +- half_width (shuffled, so the longest requests sit anywhere in the
  batch, as in a real one), timed like the grid's (`step_time_s`, `host_time_s`, `stream_time_s`),
  with its longest length past the mean (`max_minus_mean`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from tallyserve.core.kv_cache_manager import cdiv
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.request import PLACEHOLDER_TOKEN_ID
from tallyserve.sampling_params import SamplingParams
from tallyserve.config.args import add_engine_args
from tallyserve.engine.llm_engine import LLMEngine
from tallyserve.config.args import engine_args_from
from tallyserve.sim.cost_model import StepShape


def rows_output(rows: Sequence[tuple[int, int]], block_size: int, num_blocks: int) -> SchedulerOutput:
    """A synthetic step of (new tokens, tokens already cached) rows, every row sampled; block ids
    wrap around the pool (contents do not matter for timing)."""
    greedy = SamplingParams(temperature=0.0)
    entries, next_block = [], 0
    for i, (n, context) in enumerate(rows):
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


def grid_step(batch_size: int, extra: int, context: int, block_size: int, num_blocks: int) -> SchedulerOutput:
    """The grid's step: ``batch_size`` requests with ``context`` tokens cached, one new token each,
    the first ``1 + extra``."""
    return rows_output([(1 + (extra if i == 0 else 0), context) for i in range(batch_size)], block_size, num_blocks)


def spread_lengths(batch_size: int, context: int, half_width: int) -> list[int]:
    """``batch_size`` context lengths spread evenly over [context - w, context + w] (w = half_width, at most
    ``context``) with mean ``context`` (to rounding), in a fixed shuffled order."""
    import numpy as np

    w = min(half_width, context)
    lens = [context + round(w * ((2 * i + 1) / batch_size - 1)) for i in range(batch_size)]
    order = np.random.default_rng(0).permutation(batch_size)
    return [lens[i] for i in order]


def measure_decode_spread(engine, batch_sizes: Sequence[int], context_lens: Sequence[int], half_width: int,
                          repeats: int) -> dict:
    """Decode steps with uneven lengths (``spread_lengths``) at each batch size > 1 and context > 0,
    timed as the grid's steps are."""
    cc = engine.config.cache_config
    bs = [b for b in batch_sizes if b > 1]
    cs = [c for c in context_lens if c > 0]
    out = {"half_width": half_width, "batch_size": bs, "context_len": cs, "max_minus_mean": [],
           "step_time_s": [], "host_time_s": [], "stream_time_s": []}
    if half_width <= 0 or not bs or not cs:
        return {}
    for b in bs:
        rows = {k: [] for k in ("max_minus_mean", "step_time_s", "host_time_s", "stream_time_s")}
        for c in cs:
            lens = spread_lengths(b, c, half_width)
            so = rows_output([(1, n) for n in lens], cc.block_size, cc.num_blocks)
            total, host = time_step(engine, so, repeats)
            rows["max_minus_mean"].append(max(lens) - sum(lens) / b)
            rows["step_time_s"].append(total)
            rows["host_time_s"].append(host)
            rows["stream_time_s"].append(time_stream(engine, so, repeats))
        for k, v in rows.items():
            out[k].append(v)
    return out


def graph_batch_sizes(engine) -> list[int]:
    """The engine's CUDA-graph capture sizes (decode steps), empty when it runs eagerly."""
    graphs = getattr(getattr(engine, "runner", None), "graph_runner", None)
    return [int(b) for b in graphs.buckets] if graphs is not None and graphs.graphs else []


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


def time_stream(engine, so: SchedulerOutput, repeats: int) -> float:
    """Median period of the step launched back to back ``repeats + 2`` times as the engine core's
    async loop launches steps: step N+1 built (against step N's handle) and launched, then step N's
    results read. As in that loop, step N+1's one-token rows are placeholders the device fills from
    step N's sampled tokens. The periods counted are those of steps whose successor was launched
    first."""
    executor, device = engine.executor, engine.device
    follow = dataclasses.replace(so, async_scheduled=True, requests=tuple(
        e._replace(token_ids=(PLACEHOLDER_TOKEN_ID,)) if e.num_tokens == 1 else e for e in so.requests))
    _sync(device)
    handle = executor.launch(so, executor.prepare(so, None), None)
    done = []
    for _ in range(repeats + 1):
        nxt = executor.launch(follow, executor.prepare(follow, handle), handle)
        handle.result()
        done.append(time.perf_counter())
        handle = nxt
    handle.result()
    _sync(device)
    return statistics.median([b - a for a, b in zip(done, done[1:])])


def measure_pair_time(engine, tokens: int, repeats: int) -> dict:
    """Seconds per causal query-key pair of prefill attention: ``tokens`` new tokens from position 0
    as one request, then split evenly over 2, 4 and 8 (chunks of at least 2 tokens), timed on their
    own; the least-squares slope of step time over ``StepShape.extra_attn_pairs`` (>= 0). The split
    steps also sample up to 8 rows instead of one."""
    cc = engine.config.cache_config
    splits = [k for k in (1, 2, 4, 8) if tokens // k >= 2]
    pairs, times = [], []
    for k in splits:
        rows = [(tokens // k + (1 if i < tokens % k else 0), 0) for i in range(k)]
        so = rows_output(rows, cc.block_size, cc.num_blocks)
        pairs.append(StepShape.of(so).extra_attn_pairs)
        times.append(time_step(engine, so, repeats)[0])
    slope = 0.0
    if len(splits) > 1:
        mp, mt = statistics.fmean(pairs), statistics.fmean(times)
        var = sum((p - mp) ** 2 for p in pairs)
        slope = max(0.0, sum((p - mp) * (t - mt) for p, t in zip(pairs, times)) / var) if var else 0.0
    return {"prefill_pair_time_s": slope,
            "prefill_split": {"tokens": tokens, "requests": splits, "extra_attn_pairs": pairs, "step_time_s": times}}


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def run_profile(engine, batch_sizes: Sequence[int], extra_tokens: Sequence[int], context_lens: Sequence[int],
                repeats: int = 3, progress: bool = True, decode_spread: int = 384) -> dict:
    """``decode_spread``: the half width of the uneven decode steps (`measure_decode_spread`; 0: none)."""
    for name, axis, lo in (("batch sizes", batch_sizes, 1), ("extra tokens", extra_tokens, 0),
                           ("context lengths", context_lens, 0)):
        if not axis or sorted(set(axis)) != list(axis) or axis[0] < lo:
            raise ValueError(f"{name} must be strictly increasing integers >= {lo}, got {list(axis)}")
    max_len = engine.config.scheduler_config.max_model_len
    if context_lens[-1] + extra_tokens[-1] + 1 > max_len:
        raise ValueError(f"largest context + extra tokens + 1 = {context_lens[-1] + extra_tokens[-1] + 1} "
                         f"exceeds max_model_len {max_len}")
    if decode_spread < 0:
        raise ValueError(f"decode spread must be >= 0, got {decode_spread}")
    decode_spread = min(decode_spread, max_len - 1 - context_lens[-1])  # the longest spread row must fit
    cc = engine.config.cache_config
    bar = tqdm(total=len(batch_sizes) * len(extra_tokens) * len(context_lens), desc="profile", disable=not progress)
    table, host_table, stream_table = [], [], []
    for b in batch_sizes:
        rows, host_rows, stream_rows = [], [], []
        for e in extra_tokens:
            cells, host_cells, stream_cells = [], [], []
            for c in context_lens:
                so = grid_step(b, e, c, cc.block_size, cc.num_blocks)
                total, host = time_step(engine, so, repeats)
                cells.append(total)
                host_cells.append(host)
                stream_cells.append(time_stream(engine, so, repeats))
                bar.update(1)
            rows.append(cells)
            host_rows.append(host_cells)
            stream_rows.append(stream_cells)
        table.append(rows)
        host_table.append(host_rows)
        stream_table.append(stream_rows)
    bar.close()
    pairs = measure_pair_time(engine, extra_tokens[-1] + 1, repeats) if extra_tokens[-1] > 0 else {}
    spread = measure_decode_spread(engine, batch_sizes, context_lens, decode_spread, repeats)
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
        "stream_time_s": stream_table,
        **pairs,
        "cuda_graph_batch_sizes": graph_batch_sizes(engine),
        **({"decode_spread": spread} if spread else {}),
    }


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_profile(ns: argparse.Namespace) -> int:
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    engine = LLMEngine(engine_args_from(ns))
    profile = run_profile(engine, ns.batch_sizes, ns.extra_tokens, ns.context_lens, ns.repeats,
                          progress=not ns.disable_tqdm, decode_spread=ns.decode_spread)
    with open(ns.output, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {ns.output}: {len(ns.batch_sizes) * len(ns.extra_tokens) * len(ns.context_lens)} points on "
          f"{profile['device']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure step times over a grid for `simulate --hardware PROFILE.json`",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 128], help="requests per step")
    p.add_argument("--extra-tokens", type=_ints, default=[0, 128, 512, 2048],
                   help="prefill tokens beyond one per request")
    p.add_argument("--context-lens", type=_ints, default=[0, 1024, 4096], help="KV tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median), after one warm-up")
    p.add_argument("--decode-spread", type=int, default=384,
                   help="half width of the uneven decode steps timed at each batch size and context (0: none)")
    p.add_argument("--output", default="profile.json")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=_cmd_profile)
