#!/usr/bin/env python3
"""What features cost and gain: structured outputs, prompt logprobs, the host KV tier, speculative decoding,
tensor-parallel workers.

    python benchmarks/features.py structured [--model llama-3-8b --load-format dummy --num-requests 256]
    python benchmarks/features.py structured-fill --rows 256 --vocab-size 128256   # the host work alone, no model
    python benchmarks/features.py prompt-logprobs     # parity with transformers; the cost on a GPU
    python benchmarks/features.py offline             # host KV tier and n-gram speculation on the bundled model (CPU)
    python benchmarks/features.py tp-overhead         # tensor-parallel worker overhead on the CPU (gloo)

`COMMAND --help` says what each measures and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import _common  # noqa: F401  (the import path)
from tallyserve import LLM, SamplingParams, StructuredOutputsParams

STRUCTURED_DOC = """The cost of structured outputs: N requests constrained by a JSON schema vs the same prompts
without one, with the same output lengths, in output tokens per second.:

    python benchmarks/features.py structured [--model bundled] [--num-requests 8] [--items 16]
    python benchmarks/features.py structured --model llama-3-8b --load-format dummy --num-requests 256

The schema asks for an array of exactly ``--items`` small objects (bounded integers and enums,
compact JSON), so even random weights write a long answer that ends: each answer ends with EOS
where the grammar allows it. The unconstrained run then generates exactly as many tokens per
request (ignore_eos, max_tokens = that request's structured length), greedy both times, so the
two runs compute the same number of tokens and the ratio is the constraint's own cost (bitmask
fill on the host, masking on the device, compile excluded: a warm-up compiles the grammar first).

Dummy presets have no tokenizer: the bundled model's (SmolLM2) is used for the grammar unless
--tokenizer names one; its token ids are a subset of any larger vocabulary's. The grammars are then
compiled over the tokenizer's 49k ids and the logits past them are masked (``grammar_vocab_size`` in
the output), as for any model whose logits are wider than its tokenizer; the answers end with the
tokenizer's EOS, which the engine stops on like the preset's own. Prints one JSON
object (also written to $OUT/structured_overhead.json when $OUT is set)."""

FILL_DOC = """Host cost of one structured-output step, without a model: N sequences under the JSON schema of
``structured`` advance by one token each per step (a random token their grammar
allows), and each step times the engine's matcher update (``StructuredOutputManager.advance``) and
the bitmask fill of N rows (``bitmask_for``). This is the host work async scheduling overlaps with a
step's forward pass.:

    python benchmarks/features.py structured-fill [--rows 256] [--vocab-size 128256] [--steps 60]

The bundled model's tokenizer describes the vocabulary (padded to --vocab-size, e.g. Llama-3's).
Prints one JSON object (milliseconds per step, the first --warmup steps excluded)."""

LOGPROBS_DOC = """Prompt logprobs on a GPU: parity with transformers on a tiny float32 model (CUDA graphs and async
scheduling on, chunked prefill, a cached prefix on offer, a mixed batch), then the cost of scoring a
2048-token prompt on Llama-3-8B's shapes (dummy bf16 weights, 128k vocabulary): extra peak memory and
time against the same prompt without prompt_logprobs.

    python benchmarks/features.py prompt-logprobs"""

OFFLINE_DOC = """CPU benchmark of two offline features on the bundled model:

1. multi-turn conversations with and without the host KV tier, in a device pool too small to keep
   every conversation's prefix (prefix-hit rate, tokens recomputed, throughput);
2. speculative decoding (prompt lookup) on repetitive text: acceptance rate and speed-up.

    python benchmarks/features.py offline [--conversations 8] [--turns 4] [--json out.json]"""

TP_DOC = """Tensor-parallel worker overhead on the CPU (gloo): the same greedy workload at TP=1 (in process)
and TP=N (one worker process per rank), tokens/s and milliseconds per step.

Two models: a tiny random Llama (compute is negligible, so the difference per step is the cost of
the multi-process path: pickling the SchedulerOutput, the pipe, the gloo broadcast, the all-reduces
and the logits gather), and the bundled SmolLM2-135M (9 heads: TP=3 is its smallest split).

    python benchmarks/features.py tp-overhead [--bundled-tp 3] [--prompts 16]"""



# ============================================================================= structured
def schema(items: int) -> dict:
    item = {"type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                           "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
                           "ok": {"type": "boolean"}},
            "required": ["id", "kind", "ok"]}
    return {"type": "array", "items": item, "minItems": items, "maxItems": items}


def _structured_tokenizer(args: argparse.Namespace):
    if args.tokenizer:
        return args.tokenizer
    if args.load_format != "dummy":
        return None
    from tallyserve.models.loader import resolve_model

    return resolve_model("bundled", "auto").tokenizer_dir  # dummy presets have none


def _structured_prompts(llm: LLM, n: int, prompt_len: int) -> list[dict]:
    tok = llm.get_tokenizer()
    if tok is not None and llm.engine.model_config.vocab_size >= len(tok.hf):
        ids = tok.apply_chat_template([{"role": "user", "content": "List the items as a JSON array."}],
                                      add_generation_prompt=True)
        return [{"prompt_token_ids": ids + [ids[-1]] * (i % 4)} for i in range(n)]
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    return [{"prompt_token_ids": rng.integers(0, vocab, size=prompt_len).tolist()} for _ in range(n)]


def _structured_run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def _host_ms_per_step(engine, before: tuple[dict, int]) -> dict:
    timings, steps = before
    n = max(engine.stats()["steps"] - steps, 1)
    return {k: round((v - timings.get(k, 0.0)) * 1e3 / n, 3) for k, v in engine.timings.items()} | {"steps": n}


def cmd_structured(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, STRUCTURED_DOC)
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--items", type=int, default=16, help="objects in each answer's array")
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompt length when there is no chat template")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the fastest counts")
    args = ap.parse_args(argv)

    kw = dict(load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              tokenizer=_structured_tokenizer(args))
    if args.async_scheduling is not None:
        kw["async_scheduling"] = args.async_scheduling
    llm = LLM(model=args.model, **kw)
    engine = llm.engine
    so = StructuredOutputsParams(json=schema(args.items), disable_any_whitespace=True)
    prompts = _structured_prompts(llm, args.num_requests, args.prompt_len)
    max_tokens = 40 * args.items + 16
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)

    t_warm = time.perf_counter()
    llm.generate(prompts[:2], constrained)  # compiles the grammar (and warms kernels / graphs)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    warm_s = time.perf_counter() - t_warm

    # Alternate the two runs --repeats times and keep each one's fastest: a shared machine's
    # load then weighs on both alike.
    # Each plain run generates exactly the lengths its constrained run produced (greedy answers of a
    # bf16 model may differ between runs, as batch composition changes the rounding), so the two are
    # compared in tokens per second of the same token counts.
    so_times, plain_times, so_rates, plain_rates, so_outs, so_host, plain_host = [], [], [], [], None, [], []
    for _ in range(args.repeats):
        before = (dict(engine.timings), engine.stats()["steps"])
        so_s, so_outs = _structured_run(llm, prompts, [constrained] * len(prompts))
        so_host.append(_host_ms_per_step(engine, before))
        lengths = [len(o.outputs[0].token_ids) for o in so_outs]
        plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        before = (dict(engine.timings), engine.stats()["steps"])
        plain_s, plain_outs = _structured_run(llm, prompts, plain)
        plain_host.append(_host_ms_per_step(engine, before))
        assert [len(o.outputs[0].token_ids) for o in plain_outs] == lengths, "same lengths in both runs"
        so_times.append(so_s)
        plain_times.append(plain_s)
        so_rates.append(sum(lengths) / so_s)
        plain_rates.append(sum(lengths) / plain_s)
    so_s, plain_s = min(so_times), min(plain_times)
    parsed = 0
    for o in so_outs:
        try:
            parsed += len(json.loads(o.outputs[0].text)) == args.items
        except ValueError:
            pass

    tokens = sum(lengths)
    stats = engine.stats()
    cstats = engine.structured.stats
    result = {
        "model": args.model, "load_format": args.load_format, "device": str(engine.device),
        "async_scheduling": engine.async_scheduling, "num_requests": args.num_requests, "items": args.items,
        "grammar_vocab_size": engine.structured.grammar_vocab_size,
        "output_tokens": tokens, "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in so_outs),
        "valid_json_answers": parsed,
        "structured_s": round(so_s, 3), "plain_s": round(plain_s, 3), "repeats": args.repeats,
        "structured_runs_s": [round(t, 3) for t in so_times], "plain_runs_s": [round(t, 3) for t in plain_times],
        "structured_tok_s": round(max(so_rates), 1), "plain_tok_s": round(max(plain_rates), 1),
        "ratio": round(max(so_rates) / max(plain_rates), 3),  # structured throughput / plain throughput
        # the fastest structured run's host time per step (ms): "grammar" is the matcher update and
        # bitmask fill, which async scheduling overlaps with the step's forward pass
        "structured_host_ms_per_step": so_host[so_times.index(so_s)],
        "plain_host_ms_per_step": plain_host[plain_times.index(plain_s)],  # what the grammar adds: the difference
        "grammar_compiles": cstats.compiles if cstats else 0,
        "grammar_compile_s": round(cstats.compile_seconds_sum, 3) if cstats else 0.0,
        "warmup_s": round(warm_s, 2),
        "ledger_exact": stats["scheduled_tokens"] == stats["forward_tokens"] and stats["ledger_violations"] == 0,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "structured_overhead.json").write_text(text + "\n")
    return 0 if result["ledger_exact"] and parsed == args.num_requests else 1


# ============================================================================= structured-fill
def cmd_structured_fill(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, FILL_DOC)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
    from tallyserve.models.loader import resolve_model
    from tallyserve.request import Request
    from tallyserve.runner.grammar_mask import allowed_from_bitmask
    from tallyserve.structured_output.manager import StructuredOutputManager
    from tallyserve.tokenizer import load_tokenizer

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


# ============================================================================= prompt-logprobs
def _logprobs_parity() -> None:
    import transformers

    from tallyserve.bench.tiny_models import make_tiny_model

    path = make_tiny_model(tempfile.mkdtemp(), "llama", seed=5, vocab_size=512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32", block_size=16, max_num_batched_tokens=64, enable_chunked_prefill=True,
              enable_prefix_caching=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (200, 150, 37, 2)]
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2))  # caches prompt 0
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=5) if i != 1 else
              SamplingParams(max_tokens=4, temperature=0.0) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    worst = 0.0
    for out, prompt, p in zip(outs, prompts, params):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            worst = max(worst, abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()))
            tops = [t for t, lp in sorted(entry.items(), key=lambda x: x[1].rank) if lp.rank <= 5]
            ref_top = ref[i - 1].topk(5)
            assert all(abs(ref[i - 1, t] - v) < 1e-4 for t, v in zip(tops, ref_top.values.tolist()))
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    print(f"parity on {llm.engine.device} (async={llm.engine.async_scheduling}): max |logprob - transformers| = {worst:.2e}")


def _logprobs_cost(num_tokens: int = 2048) -> None:
    llm = LLM(model="llama-3-8b", load_format="dummy", max_num_batched_tokens=num_tokens,
              enable_chunked_prefill=True, enable_prefix_caching=False, gpu_memory_utilization=0.5)
    prompt = torch.randint(0, 128000, (num_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = {}
    for k in (None, 0, 5, 20, None, 5):
        params = SamplingParams(max_tokens=1, prompt_logprobs=k)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base
        if k is not None:
            assert len(out.prompt_logprobs) == num_tokens and out.prompt_logprobs[0] is None
        rows[k] = (dt, peak)  # the last run of each counts (the first ones warm up)
    dt0, peak0 = rows[None]
    print(f"{num_tokens}-token prompt, Llama-3-8B shapes, bf16: plain {dt0 * 1e3:.1f} ms, peak +{peak0 / 2**20:.0f} MiB")
    for k in (0, 5, 20):
        dt, peak = rows[k]
        print(f"  prompt_logprobs={k}: {dt * 1e3:.1f} ms (+{(dt - dt0) * 1e3:.1f} ms), "
              f"peak +{peak / 2**20:.0f} MiB (+{(peak - peak0) / 2**20:.0f} MiB over plain)")


def cmd_prompt_logprobs(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, LOGPROBS_DOC)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of the cost measurement")
    args = ap.parse_args(argv)
    _logprobs_parity()
    if torch.cuda.is_available():
        _logprobs_cost(args.tokens)
    else:
        print("no CUDA device: the cost measurement (Llama-3-8B shapes) is skipped")
    return 0


# ============================================================================= offline
TOPICS = ["the ocean", "volcanoes", "bread baking", "the moon", "chess openings", "rainforests", "jazz", "glaciers",
          "honey bees", "old bridges", "tea", "comets"]


def _multi_turn(kv_offload_bytes: int, conversations: int, turns: int, max_tokens: int) -> dict:
    llm = LLM(num_gpu_blocks_override=48, block_size=16, max_model_len=768, kv_offload_bytes=kv_offload_bytes)
    histories = [[{"role": "system", "content": "You are a helpful assistant. Answer in two sentences."}]
                 for _ in range(conversations)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt_tokens = generated = 0
    start = time.perf_counter()
    for turn in range(turns):
        for i, h in enumerate(histories):
            h.append({"role": "user", "content": f"Tell me one more fact about {TOPICS[i % len(TOPICS)]} (part {turn + 1})."})
        outs = llm.chat(histories, params)
        for h, out in zip(histories, outs):
            h.append({"role": "assistant", "content": out.outputs[0].text})
            prompt_tokens += len(out.prompt_token_ids)
            generated += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    s = llm.stats()
    hits = s["prefix_hit_tokens"] + s["partial_hit_tokens"] + s["host_hit_tokens"]
    return {
        "kv_offload_bytes": kv_offload_bytes, "seconds": round(elapsed, 2),
        "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "tokens_per_s": round((prompt_tokens + generated) / elapsed, 1),
        # Of all tokens whose KV the engine needed, the share served from a cache instead of computed.
        "cache_hit_rate": round(hits / (hits + s["forward_tokens"]), 3), "host_hit_tokens": s["host_hit_tokens"],
        "device_hit_tokens": s["prefix_hit_tokens"] + s["partial_hit_tokens"], "preemptions": s["preemptions"],
        "forward_tokens": s["forward_tokens"], "scheduled_tokens": s["scheduled_tokens"],
        "ledger_violations": s["ledger_violations"], "block_evictions": s["block_evictions"],
        "host_blocks_offloaded": s["host_blocks_offloaded"], "kv_bytes_moved": s["kv_bytes_moved"],
    }


def _speculative(k: int, max_tokens: int) -> dict:
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 3
    chats = [[{"role": "user", "content": f"Repeat this list exactly, twice: {text}"}],
             [{"role": "user", "content": f"Copy the following text: {text}"}]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    result = {}
    for name, cfg in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": k})):
        llm = LLM(max_model_len=1024, speculative_config=cfg)
        llm.chat(chats, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        start = time.perf_counter()
        outs = llm.chat(chats, params)
        elapsed = time.perf_counter() - start
        s = llm.stats()
        result[name] = {"seconds": round(elapsed, 2), "tokens": [o.outputs[0].token_ids for o in outs],
                        "acceptance_rate": round(s["spec_acceptance_rate"], 3),
                        "mean_tokens_per_step": round(s["spec_mean_tokens_per_step"], 2),
                        "ledger_exact": s["scheduled_tokens"] == s["forward_tokens"]}
    same = result["plain"]["tokens"] == result["ngram"]["tokens"]
    for r in result.values():
        r.pop("tokens")
    return {"k": k, "same_tokens": same, "speedup": round(result["plain"]["seconds"] / result["ngram"]["seconds"], 2),
            **result}


def cmd_offline(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, OFFLINE_DOC)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--spec-k", type=int, default=4)
    ap.add_argument("--spec-tokens", type=int, default=96)
    ap.add_argument("--json")
    ns = ap.parse_args(argv)
    report = {
        "multi_turn_no_tier": _multi_turn(0, ns.conversations, ns.turns, ns.max_tokens),
        "multi_turn_host_tier": _multi_turn(256 << 20, ns.conversations, ns.turns, ns.max_tokens),
        "speculative": _speculative(ns.spec_k, ns.spec_tokens),
    }
    print(json.dumps(report, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)


# ============================================================================= tp-overhead
def _tp_run(model: str, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    llm = LLM(model=model, tensor_parallel_size=tp, async_scheduling=False, kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    after = llm.stats()
    steps = after["steps"] - before["steps"]
    tokens = after["scheduled_tokens"] - before["scheduled_tokens"]
    result = {"model": model, "tp": tp, "wall_s": round(wall, 3), "steps": steps, "ms_per_step": round(1e3 * wall / steps, 2),
              "tokens_per_s": round(tokens / wall, 1), "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "token_ids": [o.outputs[0].token_ids for o in outs]}
    llm.engine.shutdown()
    return result


def cmd_tp_overhead(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, TP_DOC)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny-tp", type=int, default=2)
    ap.add_argument("--bundled-tp", type=int, default=3)
    args = ap.parse_args(argv)
    from tallyserve.bench.tiny_models import make_tiny_model

    tiny = make_tiny_model(tempfile.mkdtemp(), "llama", seed=0)
    rng = random.Random(0)
    rows = []
    for model, tp, vocab in ((tiny, args.tiny_tp, 256), (None, args.bundled_tp, 49152)):
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        base = _tp_run(model, 1, prompts, args.max_tokens)
        split = _tp_run(model, tp, prompts, args.max_tokens)
        same = base.pop("token_ids") == split.pop("token_ids")
        rows.append({"tp1": base, f"tp{tp}": split, "same_tokens": same,
                     "overhead_ms_per_step": round(split["ms_per_step"] - base["ms_per_step"], 2),
                     "speed_ratio": round(split["tokens_per_s"] / base["tokens_per_s"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    return 0


COMMANDS: dict[str, _common.Command] = {
    "structured": ("structured outputs: JSON-schema requests against the same lengths unconstrained, tok/s",
                   cmd_structured),
    "structured-fill": ("the host cost of one structured step (matcher update, bitmask fill), no model",
                        cmd_structured_fill),
    "prompt-logprobs": ("prompt logprobs: parity with transformers (tiny model), cost on Llama-3-8B shapes (GPU)",
                        cmd_prompt_logprobs),
    "offline": ("the host KV tier on multi-turn chats and n-gram speculative decoding, bundled model", cmd_offline),
    "tp-overhead": ("tensor-parallel worker overhead on the CPU: TP=1 in process against TP=N workers", cmd_tp_overhead),
}


if __name__ == "__main__":
    sys.exit(_common.run_tool(__doc__, COMMANDS))
