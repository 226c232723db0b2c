"""Workload W of the CPU side-by-side benchmark, and the aggregation of its results.

W: the bundled SmolLM2-135M-Instruct, 64 prompts of 32-512 random token ids, 64 new tokens each, greedy,
EOS ignored, all submitted at once. The prompts come from ``random.Random(seed)``, a length, then that many ids
in [100, 40000), so W's first 16 prompts are the 16-prompt slice of the first CPU figures (``benchmarks/cpu.py w
--num-prompts 16``). With the default seed 0, W has 16,103 prompt tokens.

Pure Python (no torch): every engine's worker, the driver and the unit tests import it.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Optional, Sequence

NUM_PROMPTS = 64
MIN_PROMPT_LEN = 32
MAX_PROMPT_LEN = 512
MAX_TOKENS = 64
SEED = 0
TOKEN_ID_LOW = 100  # below: the special and byte tokens of the bundled vocabulary
TOKEN_ID_HIGH = 40000  # exclusive; the bundled vocabulary has 49,152 ids
BASELINE = "tallyserve"


def make_workload(num_prompts: int = NUM_PROMPTS, seed: int = SEED) -> list[list[int]]:
    """W's prompts as token id lists; the first n prompts of W for ``num_prompts=n`` (a prefix, not a resample)."""
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
        raise ValueError(f"num_prompts must be a positive integer, got {num_prompts!r}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randrange(MIN_PROMPT_LEN, MAX_PROMPT_LEN + 1)
        prompts.append([rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(length)])
    return prompts


def total_tokens(prompts: Sequence[Sequence[int]]) -> int:
    return sum(len(p) for p in prompts)


def describe(prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    lengths = [len(p) for p in prompts]
    return {
        "num_prompts": len(prompts),
        "prompt_tokens": sum(lengths),
        "min_prompt_len": min(lengths),
        "max_prompt_len": max(lengths),
        "max_tokens": max_tokens,
        "output_tokens": max_tokens * len(prompts),
        "greedy": True,
        "ignore_eos": True,
    }


def identical_fraction(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Fraction of prompts whose output token ids are identical in two runs of the same prompts."""
    if len(a) != len(b):
        raise ValueError(f"output lists differ in length: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("no outputs to compare")
    return sum(list(x) == list(y) for x, y in zip(a, b)) / len(a)


def common_prefix_fraction(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of (length of the common leading run of output ids) / (longer output's length)."""
    if len(a) != len(b):
        raise ValueError(f"output lists differ in length: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("no outputs to compare")
    total = 0.0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        if n == 0:
            total += 1.0
            continue
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        total += k / n
    return total / len(a)


def agreement(outputs: Mapping[str, Optional[Sequence[Sequence[int]]]]) -> dict[str, dict[str, float]]:
    """Output agreement for every pair of engines that produced outputs: ``{"a vs b": {...}}``."""
    names = [n for n, o in outputs.items() if o is not None]
    pairs: dict[str, dict[str, float]] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs[f"{a} vs {b}"] = {
                "identical": round(identical_fraction(outputs[a], outputs[b]), 4),
                "common_prefix": round(common_prefix_fraction(outputs[a], outputs[b]), 4),
            }
    return pairs


def summarize(rounds: Sequence[Mapping[str, Optional[float]]], baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Per engine over interleaved rounds: every round's time, the min, and the min's ratio to the baseline's min.

    ``rounds[r][engine]`` is the engine's W time in seconds in round r, or None where that run failed. A ratio
    above 1 means slower than the baseline. An engine with no successful round has ``min_s`` None.
    """
    engines: list[str] = []
    for r in rounds:
        for name in r:
            if name not in engines:
                engines.append(name)
    out: dict[str, dict[str, Any]] = {}
    for name in engines:
        times = [r.get(name) for r in rounds]
        ok = [t for t in times if t is not None]
        out[name] = {"times_s": [None if t is None else round(t, 4) for t in times],
                     "min_s": round(min(ok), 4) if ok else None,
                     "rounds_ok": len(ok)}
    base = out.get(baseline, {}).get("min_s")
    for name, row in out.items():
        row[f"vs_{baseline}"] = round(row["min_s"] / base, 3) if base and row["min_s"] is not None else None
    return out


def summarize_serving(rounds: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Serving mode over rounds: per server and stream count, the best round's figures (each metric on its own).

    ``rounds[r][server]`` is ``{"runs": [{"streams", "mean_ttft_ms", "mean_tpot_ms", "output_tok_per_s", ...}]}``
    or ``{"error": ...}``. Result: ``{server: {"streams=<n>": {"mean_ttft_ms": min, "mean_tpot_ms": min,
    "output_tok_per_s": max, "rounds_ok": k}}}``; a run counts only when all its requests answered.
    """
    out: dict[str, dict[str, Any]] = {}
    for r in rounds:
        for server, res in r.items():
            rows = out.setdefault(server, {})
            for run in res.get("runs", []):
                key = f"streams={run['streams']}"
                row = rows.setdefault(key, {"mean_ttft_ms": None, "mean_tpot_ms": None, "output_tok_per_s": None,
                                            "rounds_ok": 0})
                if run.get("ok") != run.get("requests"):
                    continue
                row["rounds_ok"] += 1
                for metric, best in (("mean_ttft_ms", min), ("mean_tpot_ms", min), ("output_tok_per_s", max)):
                    value = run.get(metric)
                    if value is not None:
                        row[metric] = value if row[metric] is None else best(row[metric], value)
    return out
