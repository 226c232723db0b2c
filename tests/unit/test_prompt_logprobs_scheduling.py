"""Randomised (hypothesis) scheduling of requests with and without prompt_logprobs on the model-free
oracle runner: a request with prompt_logprobs is admitted with no prefix hit before its first token
(cached and host blocks alike), its chunks name exactly the prompt tokens their rows score, every
prompt token but the first is scored by the time it samples (also across preemptions), none after;
requests without prompt_logprobs keep their hits; the ledger is exact and no block leaks."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tallyserve.config import CacheConfig, SchedulerConfig
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tests.kv_oracle import OracleRunner, VOCAB, reference_output

EXAMPLES = int(os.environ.get("TALLYSERVE_FUZZ_EXAMPLES", "60"))


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    max_len = 48
    # a pool that holds one whole request (48 tokens at most) and little more: preemptions are common
    num_blocks = draw(st.integers(max_len // block_size + 1, max_len // block_size + 6))
    cfg = dict(block_size=block_size, budget=draw(st.integers(4, 24)), num_blocks=num_blocks,
               host_blocks=draw(st.sampled_from([0, 16])), async_sched=draw(st.booleans()))
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=20))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        share = draw(st.integers(0, len(shared)))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        prompt = (shared[:share] + tail)[: max_len - 16]
        k = draw(st.one_of(st.none(), st.integers(0, 3)))
        reqs.append((f"r{i}", prompt, draw(st.integers(1, 16)), draw(st.integers(0, 3)), k))
    return cfg, reqs


def _run(cfg, reqs, max_steps=2000):
    sched = Scheduler(SchedulerConfig(cfg["budget"], 8, 48, True),
                      CacheConfig(cfg["block_size"], cfg["num_blocks"], True, True, cfg["host_blocks"]))
    runner = OracleRunner(cfg["num_blocks"], cfg["block_size"], cfg["host_blocks"])
    objs: dict[str, Request] = {}
    scored: dict[str, set[int]] = {}  # prompt indices whose logprobs some chunk's rows computed
    hits_of_plain = 0
    in_flight = None
    last_arrival = max(r[3] for r in reqs)
    for step in range(max_steps):
        for rid, prompt, max_tokens, arrive, k in reqs:
            if arrive == step:
                objs[rid] = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                prompt_logprobs=k), max_tokens=max_tokens)
                sched.add_request(objs[rid])
        waiting = {r.request_id for r in sched.waiting}
        so = sched.schedule(async_scheduling=cfg["async_sched"])
        for e in so.requests:
            req = objs[e.request_id]
            wants = req.sampling_params.prompt_logprobs is not None
            prompt = req.prompt_token_ids
            num_real = e.num_tokens - e.num_draft_tokens
            # output tokens before this step (an async step appended its placeholder already)
            before = req.num_output_tokens - (1 if cfg["async_sched"] and e.sample else 0)
            if e.request_id in waiting:  # admitted in this step, after its prefix hit was committed
                if wants and before == 0:
                    assert e.start_position == 0, f"{e.request_id} took a prefix hit of {e.start_position}"
                elif not wants:
                    hits_of_plain += e.start_position
            if not wants or before > 0:
                assert e.prompt_logprob_targets == ()
                continue
            first = e.start_position + 1
            assert len(e.prompt_logprob_targets) == max(0, min(num_real, len(prompt) - first))
            for j, t in enumerate(e.prompt_logprob_targets):
                assert t == prompt[first + j]
                scored.setdefault(e.request_id, set()).add(first + j)
            if e.sample:  # its first token: the whole prompt is scored by now
                assert scored.get(e.request_id, set()) == set(range(1, len(prompt)))
        launched = None
        if so.requests:
            batch, sampled = runner.execute(so, {rid: r.all_token_ids for rid, r in objs.items()})
            ledger.check_step(so.total_tokens, batch.num_tokens, cfg["budget"])
            launched = (so, sampled)
        if cfg["async_sched"]:
            launched, in_flight = in_flight, launched
        if launched is not None:
            sched.update(*launched)
        sched.kv.check_integrity()
        if step > last_arrival and not sched.has_unfinished_requests() and in_flight is None:
            break
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == cfg["num_blocks"]
    for rid, prompt, max_tokens, _, k in reqs:
        r = objs[rid]
        assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == reference_output(prompt, max_tokens)
        if k is not None:
            assert scored.get(rid, set()) == set(range(1, len(prompt)))
    return sched, hits_of_plain


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 100)
@given(workloads())
def test_hypothesis_prompt_logprobs_scheduling(workload):
    cfg, reqs = workload
    sched, _ = _run(cfg, reqs)
    assert sched.stats.ledger_violations == 0


def test_plain_requests_keep_their_hits_beside_scored_ones():
    """The same prompt three times: plain, scored (no hit), plain again (hits what the others cached)."""
    prompt = list(range(3, 23))
    cfg = dict(block_size=4, budget=16, num_blocks=40, host_blocks=0, async_sched=False)
    reqs = [("a", prompt, 2, 0, None), ("b", prompt, 2, 6, 1), ("c", prompt, 2, 12, None)]
    sched, plain_hits = _run(cfg, reqs)
    assert plain_hits == 19  # "c" hit all but its last token (4 full blocks, 3 tokens of a partial one)
    assert (sched.stats.prefix_hit_tokens, sched.stats.partial_hit_tokens) == (16, 3)  # "b" hit nothing


def test_preempted_after_its_first_token_it_reuses_its_blocks_and_scores_nothing_again():
    """A scored request preempted while decoding (the latest arrival is the victim) has its prompt
    logprobs already: it comes back through the prefix cache and its chunks name no targets."""
    a, b = list(range(3, 23)), list(range(40, 60))
    for async_sched in (False, True):
        cfg = dict(block_size=4, budget=16, num_blocks=13, host_blocks=0, async_sched=async_sched)
        sched, plain_hits = _run(cfg, [("b", b, 16, 0, None), ("a", a, 16, 1, 2)])
        assert sched.stats.preemptions > 0 and plain_hits == 0
        assert sched.stats.prefix_hit_tokens > 0  # "a" came back on its own cached blocks
