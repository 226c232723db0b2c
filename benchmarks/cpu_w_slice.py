"""A slice of the CPU workload W on the bundled model: 16 prompts of 32-512 random tokens, 64 new tokens each,
greedy, ignore_eos, LLM() defaults. Prints the wall time; `python benchmarks/cpu_w_slice.py prof` adds a
torch profile of the top operators."""
import time, random, sys, torch
from tallyserve import LLM, SamplingParams
llm = LLM()
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(32, 513))]} for _ in range(16)]
sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
eng = llm.engine
t = time.perf_counter()
if len(sys.argv) > 1:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, sp)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
else:
    outs = llm.generate(prompts, sp)
print(f"mini-W: {time.perf_counter() - t:.2f} s, prompt tokens {sum(len(p['prompt_token_ids']) for p in prompts)}, threads {torch.get_num_threads()}")
