"""CPU benchmark of two offline features on the bundled model:

1. multi-turn conversations with and without the host KV tier, in a device pool too small to keep
   every conversation's prefix (prefix-hit rate, tokens recomputed, throughput);
2. speculative decoding (prompt lookup) on repetitive text: acceptance rate and speed-up.

Usage: .venv/bin/python benchmarks/offline_features.py [--conversations 8] [--turns 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from tallyserve import LLM, SamplingParams

TOPICS = ["the ocean", "volcanoes", "bread baking", "the moon", "chess openings", "rainforests", "jazz", "glaciers",
          "honey bees", "old bridges", "tea", "comets"]


def multi_turn(kv_offload_bytes: int, conversations: int, turns: int, max_tokens: int) -> dict:
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


def speculative(k: int, max_tokens: int) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--spec-k", type=int, default=4)
    ap.add_argument("--spec-tokens", type=int, default=96)
    ap.add_argument("--json")
    ns = ap.parse_args()
    report = {
        "multi_turn_no_tier": multi_turn(0, ns.conversations, ns.turns, ns.max_tokens),
        "multi_turn_host_tier": multi_turn(256 << 20, ns.conversations, ns.turns, ns.max_tokens),
        "speculative": speculative(ns.spec_k, ns.spec_tokens),
    }
    print(json.dumps(report, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
