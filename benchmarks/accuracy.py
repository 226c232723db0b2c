#!/usr/bin/env python3
"""What FP8 costs in answers: a model with real weights (the bundled SmolLM2-135M-Instruct by default) in its own
dtype, with `quantization="fp8"`, and with FP8 weights and `kv_cache_dtype="fp8"`:

    python benchmarks/accuracy.py [--model DIR] [--device cpu|cuda] [--dtype auto] [--max-tokens 64]

For each configuration it prints the perplexity of a fixed English text (the model's prompt log-probabilities,
one pass) and, against the first configuration, the greedy chat answers to 32 fixed prompts: how many are equal
token for token and the mean share of each answer that agrees before the first difference. On the CPU the FP8
weights are dequantized (so this measures FP8's rounding of weights and KV, not of activations); on a GPU with FP8
tensor cores the activations are rounded too. With $OUT set, everything goes to $OUT/accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

TEXT = """\
The river town woke slowly. Before the sun cleared the hills, the baker had already lit his ovens, and the smell
of bread drifted down the narrow street towards the water. Fishermen checked their nets by lantern light, talking
quietly about the weather and the price of diesel. A cat sat on the harbour wall and watched them with the patience
of an animal that knows breakfast will come. At seven the school bus rattled over the stone bridge, and the
children in the back seats pressed their faces to the windows to count the boats. Most mornings there were
eleven; today there were twelve, because a sailing yacht with a blue hull had come in during the night.
Nobody knew whose it was. The harbour master wrote its name in his book, asked the baker whether anyone had bought
more bread than usual, and walked to the end of the pier to look at it more closely. The deck was tidy, the sails
were folded, and a small wooden sign hung from the railing: "Back at noon. Please do not feed the dog."
There was no dog in sight. By lunchtime half the town had found a reason to walk past the pier. The school
teacher brought her class to practise drawing boats. The mayor came to discuss a new parking scheme with the
harbour master, though both of them spent most of the meeting looking at the yacht. At exactly twelve o'clock an
old woman in a yellow raincoat came down the street with a paper bag from the bakery and a large grey dog on a
lead. She nodded to everyone, climbed aboard, gave the dog a bread roll, and began to unfold the sails.
"Where are you going?" the harbour master called. "South," she said, "until the coffee is better." The town
laughed, the dog barked, and the yacht slipped out past the breakwater into a bright and empty sea.
"""

CHAT_PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "Give me three tips for learning a new language.", "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What does a CPU do?",
    "Name three planets in our solar system.", "How do I boil an egg?",
    "What is the difference between weather and climate?", "Write a short poem about autumn.",
    "Who wrote 'Pride and Prejudice'?", "What is the boiling point of water in Fahrenheit?",
    "Describe a cat to someone who has never seen one.", "What are prime numbers?",
    "Suggest a name for a friendly robot.", "How does a rainbow form?",
    "What is the largest ocean on Earth?", "Give an example of a renewable energy source.",
    "What should I pack for a weekend hike?", "Explain what a verb is.",
    "What is the tallest mountain in the world?", "Tell me a fun fact about octopuses.",
    "How do plants drink water?", "What is gravity?",
    "Write one sentence using the word 'serendipity'.", "What is the square root of 144?",
    "How can I sleep better?", "What is the main ingredient in guacamole?",
]

CONFIGS = {"base": {}, "fp8": {"quantization": "fp8"}, "fp8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}


def perplexity(llm, text: str) -> tuple[float, int]:
    from tallyserve import SamplingParams

    ids = llm.get_tokenizer().encode(text)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    nll = [-next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll)), len(nll)


def answers(llm, max_tokens: int) -> list[list[int]]:
    from tallyserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    equal, shares = 0, []
    for x, y in zip(a, b):
        equal += x == y
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shares.append(n / max(len(x), len(y), 1))
    return equal, sum(shares) / len(shares)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory or .gguf (default: the bundled model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from tallyserve import LLM

    results, base = {}, None
    for name, extra in CONFIGS.items():
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype, **extra)
        ppl, tokens = perplexity(llm, TEXT)
        toks = answers(llm, args.max_tokens)
        row = {"perplexity": ppl, "text_tokens": tokens, "kv_cache_dtype": llm.stats()["kv_cache_dtype"]}
        if base is None:
            base = (ppl, toks)
        else:
            equal, share = agreement(base[1], toks)
            row.update(perplexity_vs_base=ppl / base[0] - 1, equal_answers=equal, agreeing_share=share)
        results[name] = row
        llm.shutdown()
        print(name, json.dumps(row), flush=True)
    print(f"\n{'config':8} {'perplexity':>10} {'vs base':>8} {'equal answers':>14} {'agreeing share':>15}")
    for name, r in results.items():
        print(f"{name:8} {r['perplexity']:10.3f} {r.get('perplexity_vs_base', 0) * 100:+7.2f}% "
              f"{r.get('equal_answers', len(CHAT_PROMPTS)):>10}/{len(CHAT_PROMPTS)} {r.get('agreeing_share', 1.0):15.3f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "accuracy.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                                       indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
