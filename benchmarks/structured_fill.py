#!/usr/bin/env python3
"""Host cost of one structured-output step, without a model: N sequences under the JSON schema of
``structured_overhead.py`` advance by one token each per step (a random token their grammar
allows), and each step times the engine's matcher update (``StructuredOutputManager.advance``) and
the bitmask fill of N rows (``bitmask_for``). This is the host work async scheduling overlaps with a
step's forward pass. Run from the repo root:

    python3 benchmarks/structured_fill.py [--rows 256] [--vocab-size 128256] [--steps 60]

The bundled model's tokenizer describes the vocabulary (padded to --vocab-size, e.g. Llama-3's).
Prints one JSON object (milliseconds per step, the first --warmup steps excluded).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from structured_overhead import schema  # noqa: E402

from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput  # noqa: E402
from tallyserve.models.loader import resolve_model  # noqa: E402
from tallyserve.request import Request  # noqa: E402
from tallyserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from tallyserve.structured_output.bitmask import allowed_from_bitmask  # noqa: E402
from tallyserve.structured_output.manager import StructuredOutputManager  # noqa: E402
from tallyserve.tokenizer import load_tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    tok = load_tokenizer(resolve_model("bundled", "auto").tokenizer_dir)
    eos = tok.eos_token_id
    manager = StructuredOutputManager(tok, args.vocab_size, [eos])
    so_params = StructuredOutputsParams(json=schema(args.items), disable_any_whitespace=True)
    compiled = manager.compile(so_params)
    params = SamplingParams(max_tokens=100_000, structured_outputs=so_params)
    reqs = []
    for i in range(args.rows):
        req = Request(str(i), [1, 2, 3], params, max_tokens=100_000, eos_token_ids=(eos,))
        manager.register(req.request_id, compiled, "json")
        reqs.append(req)
    rng = random.Random(0)
    advance_s = fill_s = 0.0
    timed = 0
    for step in range(args.steps + args.warmup):
        live = [r for r in reqs if not manager.is_terminated(r.request_id)]
        if not live:
            break
        entries = tuple(ScheduledRequest(r.request_id, (0,), r.num_tokens - 1, (0,), True, params, r.num_output_tokens)
                        for r in live)
        so = SchedulerOutput(step + 1, entries, len(entries))
        t0 = time.perf_counter()
        manager.advance(live)
        t1 = time.perf_counter()
        bitmask = manager.bitmask_for(so, {r.request_id: r for r in live})
        t2 = time.perf_counter()
        if step >= args.warmup:
            advance_s, fill_s, timed = advance_s + t1 - t0, fill_s + t2 - t1, timed + 1
        allowed = allowed_from_bitmask(bitmask.bitmask, args.vocab_size)
        for i, r in enumerate(live):
            ids = allowed[i].nonzero().flatten().tolist()
            r.all_token_ids.append(rng.choice([t for t in ids if t != eos] or ids))
    result = {"rows": args.rows, "vocab_size": args.vocab_size, "steps_timed": timed,
              "advance_ms_per_step": round(advance_s * 1e3 / max(timed, 1), 3),
              "fill_ms_per_step": round(fill_s * 1e3 / max(timed, 1), 3)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
