"""Test helpers for runs of the offline engine: greedy token ids of a batch of token-id prompts, the ledger and
pool checks every parity test ends with, and an engine that is shut down (its worker processes reaped) even when
the test fails."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from tallyserve import LLM, SamplingParams


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def assert_ledger(llm: LLM) -> dict:
    """Every step computed what it charged, nothing failed, and every block is back in the pool; the stats."""
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] > 0 and s["ledger_violations"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    return s


@contextmanager
def engine(**kwargs) -> Iterator[LLM]:
    """``LLM(**kwargs)``, shut down on the way out (tensor-parallel workers included)."""
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()
