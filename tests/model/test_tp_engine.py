"""Tensor parallelism through the whole engine on the CPU (two gloo worker processes): TP=2 gives
token-for-token the same outputs and the same ledger as TP=1 on tiny random Llama (one KV head),
Mistral, Qwen2 (tied embeddings) and Qwen3 under chunked prefill, partial prefix reuse and
preemption; seeded sampling, n=2 and beam search agree too. Bad sizes fail before any worker
starts; a killed worker makes the next step raise ExecutorDeadError and takes the others down; two
"nodes" on localhost (node 1 running only workers) serve the same tokens. Every TP engine's worker
processes are checked gone at the end."""

from __future__ import annotations

import os
import random
import signal
import socket

import pytest

from tallyserve import LLM, SamplingParams
from tallyserve.config import EngineArgs
from tallyserve.engine.beam_search import BeamSearchParams
from tallyserve.executor.abstract import ExecutorDeadError
from tests.tiny_models import make_tiny_model

MAX_TOKENS = 10
CASES = {
    "llama-kv1": dict(arch="llama", num_key_value_heads=1),  # one KV head, replicated on both ranks
    "mistral": dict(arch="mistral"),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
}
SCENARIOS = {
    # the 16-token budget chunks every prompt longer than that
    "chunked": dict(max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=128),
    # shared prefixes of 13 / 21 / 30 tokens: not multiples of the 4-token block
    "prefix": dict(block_size=4, enable_prefix_caching=True, enable_partial_reuse=True, num_gpu_blocks_override=128),
    # 16 blocks x 4 tokens: the batch does not fit, requests get preempted and recomputed
    "preempt": dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64),
}
LEDGER_KEYS = ("steps", "scheduled_tokens", "forward_tokens", "prefix_hit_tokens", "partial_hit_tokens",
               "preemptions", "ledger_violations", "step_errors")


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(37)]
    return [shared[:share] + [rng.randrange(3, 250) for _ in range(tail)]
            for share, tail in [(0, 3), (13, 9), (13, 4), (21, 11), (0, 40), (21, 2), (30, 7), (13, 6), (30, 1)]]


PROMPTS = _prompts()
WAVES = (PROMPTS[:4], PROMPTS[4:])  # the second wave shares prefixes the first one cached


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), seed=i, **kw) for i, (name, kw) in enumerate(CASES.items())}


def _greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS, n: int = 1) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [[c.token_ids for c in o.outputs] for o in outs]


def _ledger(llm: LLM) -> dict:
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] > 0, s
    assert s["ledger_violations"] == 0 and s["step_errors"] == 0, s
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    return {k: s[k] for k in LEDGER_KEYS}


def _alive(proc) -> bool:
    return proc.is_alive()


def _shutdown_and_check(llm: LLM) -> None:
    procs = list(llm.engine.executor.procs)
    assert len(procs) == 2 and all(p.pid for p in procs)
    llm.engine.shutdown()
    assert not any(_alive(p) for p in procs), [(p.name, p.exitcode) for p in procs]
    for p in procs:
        with pytest.raises(ProcessLookupError):  # reaped: the pid no longer exists
            os.kill(p.pid, 0)


def _tp2(path: str, **kw) -> LLM:
    llm = LLM(model=path, tensor_parallel_size=2, **kw)
    assert llm.engine.executor.describe()["executor"] == "multiproc"
    return llm


# ----------------------------------------------------------------- greedy parity and the ledger
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(model_dirs, case, scenario):
    path, kw = model_dirs[case], SCENARIOS[scenario]
    runs = {}
    for tp in (1, 2):
        llm = LLM(model=path, **kw) if tp == 1 else _tp2(path, **kw)
        try:
            tokens = [_greedy(llm, wave) for wave in WAVES]  # two waves: the second hits the prefix cache
            runs[tp] = tokens, _ledger(llm)
        finally:
            if tp == 2:
                _shutdown_and_check(llm)
    (tok1, led1), (tok2, led2) = runs[1], runs[2]
    assert tok2 == tok1
    assert all(len(c[0]) == MAX_TOKENS or c[0][-1] == 2 for wave in tok2 for c in wave)  # eos id 2 may end one
    assert led2 == led1  # same steps, tokens, hits and preemptions: one scheduler, same pool
    if scenario == "chunked":
        assert led2["steps"] > sum(len(p) for p in PROMPTS) // 16
    elif scenario == "prefix":
        assert led2["prefix_hit_tokens"] > 0 and led2["partial_hit_tokens"] > 0
    else:
        assert led2["preemptions"] > 0


# ----------------------------------------------------------------- sampling, n, beams on one engine
@pytest.fixture(scope="module")
def pair(model_dirs):
    """TP=1 and TP=2 engines on the one-KV-head Llama, shared by the sampling tests."""
    path = model_dirs["llama-kv1"]
    tp1 = LLM(model=path, block_size=4, num_gpu_blocks_override=128)
    tp2 = _tp2(path, block_size=4, num_gpu_blocks_override=128)
    yield tp1, tp2
    _shutdown_and_check(tp2)


def test_seeded_sampling_matches(pair):
    tp1, tp2 = pair
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=100 + i) for i in range(len(prompts))]
    a = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in tp2.generate(prompts, params)]
    assert a == b
    greedy = _greedy(tp1, PROMPTS[:4], max_tokens=12)
    assert a != [g[0] for g in greedy]  # it really sampled
    again = [o.outputs[0].token_ids for o in tp2.generate(prompts, params)]
    assert again == b  # seeds, not leftover generator state
    _ledger(tp2)


def test_n2_matches(pair):
    tp1, tp2 = pair
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[1:4]]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2)
    a = [[c.token_ids for c in o.outputs] for o in tp1.generate(prompts, params)]
    b = [[c.token_ids for c in o.outputs] for o in tp2.generate(prompts, params)]
    assert all(len(x) == 2 for x in b)
    assert a == b
    assert _greedy(tp2, PROMPTS[1:4], max_tokens=8, n=2) == _greedy(tp1, PROMPTS[1:4], max_tokens=8, n=2)
    _ledger(tp2)


def test_beam_search_matches(pair):
    tp1, tp2 = pair
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    a, b = tp1.beam_search(prompts, params), tp2.beam_search(prompts, params)
    for x, y in zip(a, b):
        assert x.error is None and y.error is None, (x.error, y.error)
        assert len(y.sequences) == 3
        assert [s.tokens for s in y.sequences] == [s.tokens for s in x.sequences]
        for s1, s2 in zip(x.sequences, y.sequences):
            assert s2.cum_logprob == pytest.approx(s1.cum_logprob, abs=1e-3)
    _ledger(tp2)


# ----------------------------------------------------------------- dtype="bfloat16": bf16 projection shards
def test_tp2_bf16_matches_tp1_bf16(model_dirs):
    """Every worker applies dtype="bfloat16" (bf16 projection shards): TP=2's greedy run follows TP=1's bf16 run
    with bf16-close logprobs, and where the two part (each rank rounds its partial o/down product to bf16, so
    near-ties may flip) TP=2's token is TP=1's runner-up within bf16 noise. The logprobs are bf16's (off
    float32's by more than TP's float32 noise)."""
    path, kw = model_dirs["mistral"], dict(block_size=4, num_gpu_blocks_override=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]

    def run(llm):
        outs = llm.generate(prompts, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    bf16_tp1 = run(LLM(model=path, dtype="bfloat16", **kw))
    fp32_tp1 = run(LLM(model=path, **kw))
    tp2 = _tp2(path, dtype="bfloat16", **kw)
    try:
        bf16_tp2 = run(tp2)
        _ledger(tp2)
    finally:
        _shutdown_and_check(tp2)
    same = 0
    for (t1, lp1), (t2, lp2) in zip(bf16_tp1, bf16_tp2):
        k = next((j for j, (a, b) in enumerate(zip(t1, t2)) if a != b), min(len(t1), len(t2)))
        same += k
        for j in range(k):
            assert lp2[j][t1[j]].logprob == pytest.approx(lp1[j][t1[j]].logprob, abs=0.05)
        if k < len(t1):  # a near-tie flipped: TP=2's pick is TP=1's runner-up, within bf16 noise of its best
            assert t2[k] in lp1[k], (k, t1[k], t2[k])
            assert lp1[k][t1[k]].logprob - lp1[k][t2[k]].logprob < 0.05
    assert same >= 3 * MAX_TOKENS  # the runs agree on most tokens
    deltas = [abs(lp2[j][t].logprob - lp32[j][t].logprob)
              for (t2, lp2), (t32, lp32) in zip(bf16_tp2, fp32_tp1) for j, t in enumerate(t2[:1])]
    assert max(deltas) > 1e-4  # not float32 projections: the first token's logprob moved by bf16 rounding


# ----------------------------------------------------------------- bad sizes: no worker starts
def _children() -> set[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return {int(x) for x in f.read().split()}
    except OSError:
        return set()


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=3), r"^tensor_parallel_size=3 does not fit \w+: num_attention_heads \(4\) is not "),
    (dict(tensor_parallel_size=2, async_scheduling=True), r"^async_scheduling is not supported with tensor_parallel_size"),
    (dict(tensor_parallel_size=2, nnodes=2), r"^nnodes > 1 needs dist_init_addr"),
], ids=["tp3-4heads", "async", "nnodes-no-addr"])
def test_bad_sizes_fail_before_workers(model_dirs, kw, match, monkeypatch):
    import tallyserve.executor.multiproc as mp_exec

    spawned = []
    monkeypatch.setattr(mp_exec, "spawn_workers", lambda *a, **k: spawned.append(a) or pytest.fail("spawned"))
    before = _children()
    with pytest.raises(ValueError, match=match):
        LLM(model=model_dirs["mistral"], **kw)
    assert not spawned
    assert _children() <= before


# ----------------------------------------------------------------- a worker dies mid-run
@pytest.mark.parametrize("victim", [0, 1], ids=["kill-rank0", "kill-rank1"])
def test_killed_worker_makes_executor_dead(model_dirs, victim):
    llm = _tp2(model_dirs["llama-kv1"], block_size=4, num_gpu_blocks_override=128)
    engine, procs = llm.engine, list(llm.engine.executor.procs)
    try:
        engine.add_request("long", {"prompt_token_ids": PROMPTS[4]},
                           SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert engine.has_unfinished_requests()
        os.kill(procs[victim].pid, signal.SIGKILL)
        # noticed by the worker's exit (or its pipe), not by waiting out the worker timeout ("did not answer",
        # 300 s): the death itself ends the step, on a loaded machine as on a fast one
        with pytest.raises(ExecutorDeadError, match="exited with code|closed its pipe|is gone") as err:
            for _ in range(50):  # the step in flight when the worker dies fails; at most a step or two more
                engine.step()
        assert "did not answer" not in str(err.value)
        for p in procs:
            p.join(5)
        assert not any(p.is_alive() for p in procs), [(p.name, p.exitcode) for p in procs]
        assert procs[victim].exitcode == -signal.SIGKILL
        with pytest.raises(ExecutorDeadError):  # stays dead: no hang, no silent success
            engine.step()
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in procs)


# ----------------------------------------------------------------- two nodes on localhost
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost(model_dirs):
    from tallyserve.executor.multiproc import init_method, spawn_workers
    from tallyserve.executor.resolve import resolve_engine

    path = model_dirs["qwen3"]
    kw = dict(block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=128)
    ref = _greedy(LLM(model=path, **kw), PROMPTS[:5])
    addr = f"127.0.0.1:{_free_port()}"
    dist = dict(tensor_parallel_size=2, nnodes=2, dist_init_addr=addr)
    args1 = EngineArgs(model=path, node_rank=1, device="cpu", **dist, **kw)
    resolved, _ = resolve_engine(args1, load_tokenizer=False)
    node1, conn = spawn_workers(resolved, init_method(args1))
    assert conn is None and [p.name for p in node1] == ["tallyserve-tp-rank1"]
    llm = None
    try:
        llm = LLM(model=path, node_rank=0, **dist, **kw)
        node0 = list(llm.engine.executor.procs)
        assert [p.name for p in node0] == ["tallyserve-tp-rank0"]  # node 0 runs only its own rank
        assert _greedy(llm, PROMPTS[:5]) == ref
        _ledger(llm)
        llm.engine.shutdown()  # rank 0 tells rank 1 (on the other "node") to stop
        for p in node1:
            p.join(10)
        assert not any(p.is_alive() for p in node0 + node1)
        assert [p.exitcode for p in node1] == [0]  # a clean exit, not a kill
    finally:
        if llm is not None:
            llm.engine.shutdown()
        for p in node1:
            if p.is_alive():
                p.kill()
                p.join(5)
