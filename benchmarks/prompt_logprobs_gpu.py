"""Prompt logprobs on a GPU: parity with transformers on a tiny float32 model (CUDA graphs and async
scheduling on, chunked prefill, a cached prefix on offer, a mixed batch), then the cost of scoring a
2048-token prompt on Llama-3-8B's shapes (dummy bf16 weights, 128k vocabulary): extra peak memory and
time against the same prompt without prompt_logprobs.

    python3 benchmarks/prompt_logprobs_gpu.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tallyserve import LLM, SamplingParams  # noqa: E402


def parity() -> None:
    import transformers

    from tests.tiny_models import make_tiny_model

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


def cost(num_tokens: int = 2048) -> None:
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


if __name__ == "__main__":
    parity()
    cost()
