"""The figures a `make run` user sees, against a running server (default http://127.0.0.1:8000):
time to first token for a ~1,000-token chat prompt, and output tokens per second per stream (and in all)
for 1 and for 16 concurrent chat streams, through the official `openai` client, streaming.

    make run &            # or: tallyserve serve --port 8000
    python benchmarks/cpu_chat_figures.py --base-url http://127.0.0.1:8000/v1 --json out.json

Each chat stream asks for --max-tokens tokens with ignore_eos (vLLM's extension), so every run has the
same length; TTFT is the best of --repeats tries with a fresh prompt each time (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from openai import AsyncOpenAI

WORDS = ("river stone lantern orchard quiet signal harbor meadow copper thunder silver garden window "
         "mountain paper candle forest market winter bridge").split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_stream(client: AsyncOpenAI, model: str, text: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    pieces = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    out = usage.completion_tokens if usage else pieces
    return {"ttft_s": (first or end) - t0, "total_s": end - t0, "prompt_tokens": usage.prompt_tokens if usage else None,
            "output_tokens": out, "decode_tok_s": (out - 1) / max(end - (first or end), 1e-9)}


async def main_async(ns) -> dict:
    client = AsyncOpenAI(base_url=ns.base_url, api_key="none", max_retries=0, timeout=600)
    model = ns.model or (await client.models.list()).data[0].id
    rng = random.Random(ns.seed)
    await one_stream(client, model, prompt(rng, 20), 4)  # warm-up
    ttfts = []
    for _ in range(ns.repeats):
        r = await one_stream(client, model, prompt(rng, ns.prompt_words), 1)
        ttfts.append(r)
    report = {"model": model, "ttft_long_prompt_s": min(r["ttft_s"] for r in ttfts),
              "long_prompt_tokens": ttfts[0]["prompt_tokens"]}
    for n in ns.streams:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_stream(client, model, prompt(rng, 40), ns.max_tokens) for _ in range(n)))
        wall = time.perf_counter() - t0
        report[f"streams_{n}"] = {"per_stream_decode_tok_s": sum(r["decode_tok_s"] for r in rs) / n,
                                  "ms_per_token": 1000 * n / sum(r["decode_tok_s"] for r in rs),
                                  "total_output_tok_s": sum(r["output_tokens"] for r in rs) / wall,
                                  "ttft_p50_s": sorted(r["ttft_s"] for r in rs)[n // 2], "wall_s": wall}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-words", type=int, default=1000, help="about one token per word with these words")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    report = asyncio.run(main_async(ns))
    print(json.dumps(report, indent=1))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
