"""vLLM's concurrent partial prefill knobs: max_num_partial_prefills, max_long_partial_prefills and
long_prefill_token_threshold.

Semantics (as the scheduler implements them): running requests are scheduled first, in order, as
always. A request is *mid-prefill* while more than one of its tokens lacks KV once the step's chunk is
counted; at most max_num_partial_prefills requests are mid-prefill after any step (a waiting request
that would exceed it is not admitted, and admission stops for the step). A request is *long* in a step
when more than long_prefill_token_threshold of its tokens lack KV as the step begins (a waiting one:
after its committed prefix hit); its chunk is capped at the threshold, and at most
max_long_partial_prefills requests are long in one step: a long waiting request that finds no long
slot is skipped, so shorter requests behind it are admitted first (it keeps its place in the queue).
Threshold 0 turns "long" off. The defaults (1, 1, 0) schedule exactly as before.

Exact schedules on hand-built cases; a hypothesis property test (TALLYSERVE_FUZZ_EXAMPLES) with random
knobs: the ledger holds, the limits hold, long chunks are capped, every request finishes with the
reference output; the knobs without a threshold change nothing; bad values are ValueError.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tallyserve.config import CacheConfig, EngineArgs, SchedulerConfig
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tests.kv_oracle import VOCAB, OracleRunner, draw_requests, next_token, reference_output

EXAMPLES = int(os.environ.get("TALLYSERVE_FUZZ_EXAMPLES", "60"))


# ----------------------------------------------------------------- exact schedules
def _scheduler(budget: int, n: int = 1, n_long: int = 1, threshold: int = 0, prefix: bool = False,
               num_blocks: int = 256, max_len: int = 256, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, 16, max_len, True, n, n_long, threshold),
                     CacheConfig(block_size, num_blocks, prefix, False))


def _add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 20, base: int = 0) -> Request:
    prompt = [(base + 7 * i) % VOCAB for i in range(prompt_len)]
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), max_tokens=max_tokens)
    sched.add_request(req)
    return req


def _steps(sched: Scheduler, num_steps: int) -> list[dict[str, int]]:
    """Schedule and complete ``num_steps`` steps; each step as {request id: tokens}."""
    out = []
    for _ in range(num_steps):
        so = sched.schedule()
        out.append({e.request_id: e.num_tokens for e in so.requests})
        sched.update(so, {e.request_id: [5] for e in so.requests if e.sample})
    return out


def _four(sched: Scheduler) -> None:
    for rid, length, base in (("A", 40, 0), ("B", 6, 1), ("C", 30, 2), ("D", 5, 3)):
        _add(sched, rid, length, base=base)


def test_defaults_chunk_only_by_the_budget():
    """Today's schedule: one prefill at a time, cut only by the 16-token budget."""
    sched = _scheduler(16)
    _four(sched)
    assert _steps(sched, 6) == [
        {"A": 16},
        {"A": 16},
        {"A": 8, "B": 6, "C": 2},
        {"A": 1, "B": 1, "C": 14},
        {"A": 1, "B": 1, "C": 14},
        {"A": 1, "B": 1, "C": 1, "D": 5},
    ]


def test_threshold_caps_long_chunks_and_short_prompts_jump_the_long_one():
    """long_prefill_token_threshold 8, two partial slots, one long slot: A (40 tokens) gets 8 a step;
    C (30, long) waits for A's long slot while B and D (short) go ahead; D starts as the second
    partial prefill with the 2 tokens left in the budget."""
    sched = _scheduler(16, n=2, n_long=1, threshold=8)
    _four(sched)
    steps = _steps(sched, 1)
    assert steps == [{"A": 8, "B": 6, "D": 2}]
    assert [r.request_id for r in sched.waiting] == ["C"]  # skipped, not dropped: still first in line
    steps += _steps(sched, 7)
    assert steps == [
        {"A": 8, "B": 6, "D": 2},
        {"A": 8, "B": 1, "D": 3},  # A still long (32 left); D finishes its prompt
        {"A": 8, "B": 1, "D": 1},  # 24 left
        {"A": 8, "B": 1, "D": 1},  # 16 left: C still waits for the long slot
        {"A": 8, "B": 1, "D": 1, "C": 6},  # A's last 8 are not long: the slot is free, C starts
        {"A": 1, "B": 1, "D": 1, "C": 8},  # C long (24 left): capped at 8
        {"A": 1, "B": 1, "D": 1, "C": 8},
        {"A": 1, "B": 1, "D": 1, "C": 8},  # C's last 8, not long any more
    ]
    assert sched.stats.scheduled_tokens == sum(sum(s.values()) for s in steps)


def test_max_num_partial_prefills_stops_admission():
    """Two long slots and a threshold of 4: A and B start (4 tokens each), E (long) finds the long
    slots taken and is skipped; D (4 tokens, short) would stay mid-prefill after the 2 tokens left as a
    third partial prefill,
    so with max_num_partial_prefills=2 admission stops there, with 3 it starts."""
    for n, first in ((2, {"A": 4, "B": 4}), (3, {"A": 4, "B": 4, "D": 2})):
        sched = _scheduler(10, n=n, n_long=2, threshold=4)
        for rid, length, base in (("A", 20, 0), ("B", 20, 1), ("E", 9, 2), ("D", 4, 3)):
            _add(sched, rid, length, base=base)
        steps = _steps(sched, 2)
        assert steps[0] == first
        assert [r.request_id for r in sched.waiting][0] == "E"
        if n == 2:  # A and B still mid-prefill: D still may not start; nothing else fits
            assert steps[1] == {"A": 4, "B": 4}
        else:  # D finishes its prompt, then a third slot is free again but E is long: no room
            assert steps[1] == {"A": 4, "B": 4, "D": 2}


def test_running_requests_first_and_decodes_never_capped():
    """Decodes keep their place ahead of everything; a threshold of 1 caps prefills to one token a
    step but never a decode row."""
    sched = _scheduler(8, n=2, n_long=1, threshold=1)
    _add(sched, "a", 1)
    _add(sched, "b", 1, base=3)
    assert _steps(sched, 1) == [{"a": 1, "b": 1}]  # 1-token prompts are not long
    _add(sched, "L", 6, base=5)
    assert _steps(sched, 3) == [{"a": 1, "b": 1, "L": 1}, {"a": 1, "b": 1, "L": 1}, {"a": 1, "b": 1, "L": 1}]


def test_prefix_hit_counts_before_long():
    """Long is judged on the tokens left after the committed prefix hit (ledger rule 2): a 24-token
    prompt whose first 16 tokens are cached has 8 to compute, which is not long at threshold 8."""
    sched = _scheduler(64, n=2, n_long=1, threshold=8, prefix=True)
    _add(sched, "first", 17, max_tokens=1)
    assert _steps(sched, 3) == [{"first": 8}, {"first": 8}, {"first": 1}]
    assert not sched.requests
    _add(sched, "again", 24, max_tokens=1)  # same first 17 tokens (base 0): 4 full blocks cached
    so = sched.schedule()
    assert [(e.request_id, e.start_position, e.num_tokens) for e in so.requests] == [("again", 16, 8)]


def test_threshold_alone_with_one_partial_slot():
    """max_num_partial_prefills=1 and a threshold: one request mid-prefill at a time, capped; short
    prompts that fit whole still start beside it."""
    sched = _scheduler(16, n=1, n_long=1, threshold=8)
    _four(sched)
    # step 1: D would be cut to the 2 tokens left while A is mid-prefill: admission stops there;
    # step 2: D fits whole (not a partial prefill) and starts; C (long) still waits for A
    assert _steps(sched, 3) == [{"A": 8, "B": 6}, {"A": 8, "B": 1, "D": 5}, {"A": 8, "B": 1, "D": 1}]


def test_engine_args_reach_the_scheduler_and_the_cli():
    from tallyserve.cli import build_parser
    from tallyserve.config.args import engine_args_from
    from tallyserve.sim.cli import load_model_config

    ns = build_parser().parse_args(["simulate", "--model-config", "llama-3-8b", "--max-num-partial-prefills", "4",
                                    "--max-long-partial-prefills", "2", "--long-prefill-token-threshold", "512"])
    args = engine_args_from(ns)
    args.validate()
    assert (args.max_num_partial_prefills, args.max_long_partial_prefills, args.long_prefill_token_threshold) == (4, 2, 512)
    sc = args.resolve(load_model_config("llama-3-8b"), num_blocks=4096).scheduler_config
    assert (sc.max_num_partial_prefills, sc.max_long_partial_prefills, sc.long_prefill_token_threshold) == (4, 2, 512)
    sc = EngineArgs().resolve(load_model_config("llama-3-8b"), num_blocks=4096).scheduler_config
    assert (sc.max_num_partial_prefills, sc.max_long_partial_prefills, sc.long_prefill_token_threshold) == (1, 1, 0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=-2), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=2.0), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=True), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=None), "max_num_partial_prefills"),
    (dict(max_long_partial_prefills=0), "max_long_partial_prefills"),
    (dict(max_long_partial_prefills=2), "max_long_partial_prefills"),  # more than max_num_partial_prefills
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(long_prefill_token_threshold="512"), "long_prefill_token_threshold"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False), "max_num_partial_prefills"),
    (dict(long_prefill_token_threshold=64, enable_chunked_prefill=False), "long_prefill_token_threshold"),
])
def test_invalid_values_are_value_errors(kwargs, name):
    # the message opens with the argument's name: "<name> must be ..." or "<name> > ... needs enable_chunked_prefill"
    named = rf"^{name} (must be |> \d+ (chunks long prefills and )?needs enable_chunked_prefill)"
    with pytest.raises(ValueError, match=named):
        EngineArgs(**kwargs).validate()
    sc_kwargs = {k: v for k, v in kwargs.items() if k != "enable_chunked_prefill"}
    with pytest.raises(ValueError, match=named):
        SchedulerConfig(64, 4, 128, kwargs.get("enable_chunked_prefill", True), **sc_kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_num_partial_prefills=4, max_long_partial_prefills=4, long_prefill_token_threshold=1),
    dict(max_num_partial_prefills=1, long_prefill_token_threshold=0, enable_chunked_prefill=False),
])
def test_valid_values_pass(kwargs):
    """Valid knobs pass validation and reach the scheduler's config unchanged (the rest at their defaults)."""
    from tallyserve.sim.cli import load_model_config

    args = EngineArgs(**kwargs)
    args.validate()
    sc = args.resolve(load_model_config("llama-3-8b"), num_blocks=4096).scheduler_config
    want = {**dict(max_num_partial_prefills=1, max_long_partial_prefills=1, long_prefill_token_threshold=0,
                   enable_chunked_prefill=True), **kwargs}
    assert {k: getattr(sc, k) for k in want} == want
    direct = SchedulerConfig(sc.max_num_batched_tokens, 4, 128, **want)  # the scheduler's own check agrees
    assert (direct.max_num_partial_prefills, direct.long_prefill_token_threshold) == (
        want["max_num_partial_prefills"], want["long_prefill_token_threshold"])


# ----------------------------------------------------------------- property test
@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_len = draw(st.integers(8, 80))
    num_blocks = -(-max_len // block_size) + draw(st.sampled_from([0, 1, 2, 4, 32]))
    knobs = draw(st.booleans())
    n = draw(st.integers(1, 4)) if knobs else 1
    cfg = dict(
        block_size=block_size, max_len=max_len, num_blocks=num_blocks,
        budget=draw(st.one_of(st.integers(1, 16), st.integers(1, max_len * 2))), max_num_seqs=draw(st.integers(1, 8)),
        prefix=draw(st.booleans()), partial=draw(st.booleans()), host_blocks=draw(st.sampled_from([0, 0, 2, 16])),
        async_sched=draw(st.booleans()), eos=draw(st.one_of(st.none(), st.integers(0, VOCAB - 1))),
        n=n, n_long=draw(st.integers(1, n)), threshold=draw(st.sampled_from([0, 1, 2, 3, 5, 8, 16])) if knobs else 0,
    )
    cfg["spec"] = 0 if cfg["async_sched"] else draw(st.sampled_from([0, 0, 2]))
    return cfg, draw_requests(draw, max_len, 16, st.sampled_from([0, 0, 0, 1, 2, 4, 6]))


def _propose(sched: Scheduler, cfg: dict, step: int) -> None:
    """Drafts for decoding requests: greedy-right, and every third step one wrong."""
    for req in sched.running:
        if req.num_computed_tokens == req.num_tokens - 1:
            ctx, drafts = list(req.all_token_ids), []
            for _ in range(cfg["spec"]):
                drafts.append(next_token(ctx))
                ctx.append(drafts[-1])
            if drafts and step % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % VOCAB
            sched.set_draft_tokens(req.request_id, drafts)


def run_workload(cfg: dict, reqs: list, max_steps: int = 4000) -> tuple[Scheduler, dict, list]:
    """Drive the real scheduler through the KV oracle; check the limits every step. Returns the
    scheduler, the requests and each step's ((request id, tokens, start position), ...)."""
    sched = Scheduler(
        SchedulerConfig(cfg["budget"], cfg["max_num_seqs"], cfg["max_len"], True, cfg["n"], cfg["n_long"],
                        cfg["threshold"]),
        CacheConfig(cfg["block_size"], cfg["num_blocks"], cfg["prefix"], cfg["partial"], cfg["host_blocks"]),
    )
    runner = OracleRunner(cfg["num_blocks"], cfg["block_size"], cfg["host_blocks"])
    eos, async_sched, threshold = cfg["eos"], cfg["async_sched"], cfg["threshold"]
    objs: dict[str, Request] = {}
    by_id = {r[0]: r for r in reqs}
    in_flight, steps = None, []
    for step in range(max_steps):
        for rid, prompt, max_tokens, arrive, abort_at, prio in reqs:
            if arrive == step:
                objs[rid] = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                    max_tokens=max_tokens, priority=prio, eos_token_ids=() if eos is None else (eos,))
                sched.add_request(objs[rid])
            if abort_at == step and rid in sched.requests:
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        before = {rid: (r.num_tokens, r.num_computed_tokens) for rid, r in sched.requests.items()}
        so = sched.schedule(async_scheduling=async_sched)
        assert so.total_tokens == sum(e.num_tokens for e in so.requests) <= cfg["budget"]
        steps.append(tuple((e.request_id, e.num_tokens, e.start_position) for e in so.requests))
        real = {e.request_id: e.num_tokens - e.num_draft_tokens for e in so.requests}
        left_before = {rid: before[rid][0] - before[rid][1] for rid in before}
        for e in so.requests:
            left_before[e.request_id] = before[e.request_id][0] - e.start_position  # after the prefix hit
            if 0 < threshold < left_before[e.request_id]:
                assert real[e.request_id] <= threshold, ("long chunk not capped", e, threshold)
        mid = [r.request_id for r in sched.running
               if r.num_tokens - r.num_computed_tokens - (0 if async_sched else real.get(r.request_id, 0)) > 1]
        assert len(mid) <= cfg["n"], ("too many partial prefills", mid, cfg)
        if threshold:
            long = [r.request_id for r in sched.running if left_before[r.request_id] > threshold]
            assert len(long) <= cfg["n_long"], ("too many long prefills", long, cfg)
        launched = None
        if so.requests:
            batch, sampled = runner.execute(so, {rid: r.all_token_ids for rid, r in objs.items()})
            ledger.check_step(so.total_tokens, batch.num_tokens, cfg["budget"])
            launched = (so, sampled)
        if async_sched:
            launched, in_flight = in_flight, launched
        if launched is not None:
            sched.update(*launched)
            if cfg["spec"]:
                _propose(sched, cfg, step)
        sched.kv.check_integrity()
        if step > 6 and not sched.has_unfinished_requests() and in_flight is None:
            break
    assert not sched.has_unfinished_requests(), f"requests left after {max_steps} steps: {sched.requests}"
    assert sched.kv.num_free_blocks == cfg["num_blocks"]
    assert sched.stats.ledger_violations == 0
    for rid, r in objs.items():
        _, prompt, max_tokens, _, _, _ = by_id[rid]
        want = reference_output(prompt, max_tokens, eos)
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == want[: len(r.output_token_ids)]
        else:
            assert r.output_token_ids == want, (rid, r.status)
    return sched, objs, steps


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 100)
@given(workloads())
def test_hypothesis_partial_prefill_limits(workload):
    cfg, reqs = workload
    run_workload(cfg, reqs)


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=EXAMPLES <= 100)
@given(workloads(), st.integers(2, 4))
def test_hypothesis_partial_slots_without_threshold_change_nothing(workload, n):
    """Without a threshold a chunk is only ever cut by the budget, so at most one request is
    mid-prefill anyway: max_num_partial_prefills alone gives today's schedules."""
    cfg, reqs = workload
    base = dict(cfg, n=1, n_long=1, threshold=0)
    assert run_workload(dict(base, n=n, n_long=1), reqs)[2] == run_workload(base, reqs)[2]


def test_knobs_really_bind_through_the_oracle():
    """The threshold caps chunks and the long slot lets short requests jump the queue (KV checked
    through the oracle, every request finishes with the reference output)."""
    cfg = dict(block_size=4, max_len=64, num_blocks=64, budget=24, max_num_seqs=8, prefix=False, partial=False,
               host_blocks=0, async_sched=False, eos=None, n=3, n_long=1, threshold=6, spec=0)
    reqs = [(f"q{i}", [(i * 11 + j) % VOCAB for j in range(length)], 4, 0, None, 0)
            for i, length in enumerate((30, 4, 20, 5, 18, 3))]
    _, _, steps = run_workload(cfg, reqs)
    # q2 and q4 (long) wait for q0's long slot; 6 tokens of budget stay unused
    assert {rid: n for rid, n, _ in steps[0]} == {"q0": 6, "q1": 4, "q3": 5, "q5": 3}
    assert max(n for step in steps for rid, n, start in step if rid in ("q0", "q2", "q4")) == 6
