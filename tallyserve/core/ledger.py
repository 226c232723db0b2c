"""The ledger: THE cost function of a step, and the check that holds every step to it.

Every place that needs to know how many query tokens a request computes in a step calls
`query_tokens` and `charge` here: the scheduler charges with them, the batch builder builds
exactly what the scheduler charged, and the simulator prices the same numbers. Nothing else
computes `num_tokens - num_computed_tokens` inline.
"""

from __future__ import annotations


class LedgerError(RuntimeError):
    """The forward pass would compute a different number of tokens than the scheduler admitted."""


def query_tokens(num_tokens: int, num_computed_tokens: int, num_draft_tokens: int = 0, beam_width: int = 1) -> int:
    """Query tokens a request still needs: its uncached tail, plus draft tokens, per beam.

    `num_computed_tokens` must already include every committed prefix hit (full blocks,
    partially matching block, restored host blocks): there are no reuse estimates.
    """
    if num_computed_tokens > num_tokens:
        raise LedgerError(f"computed tokens {num_computed_tokens} exceed the sequence length {num_tokens}")
    return beam_width * (num_tokens - num_computed_tokens + num_draft_tokens)


def charge(needed: int, budget: int, chunked: bool) -> int:
    """Tokens a request computes this step: all it needs, a budget-sized chunk, or 0 (wait)."""
    if needed <= budget:
        return needed
    return max(budget, 0) if chunked else 0


def check_step(scheduled_tokens: int, forward_tokens: int, max_num_batched_tokens: int) -> None:
    """Rule 3: forward tokens == scheduled tokens <= the budget, or LedgerError."""
    if forward_tokens != scheduled_tokens:
        raise LedgerError(
            f"ledger mismatch: the scheduler admitted {scheduled_tokens} tokens "
            f"but the forward batch holds {forward_tokens}"
        )
    if scheduled_tokens > max_num_batched_tokens:
        raise LedgerError(
            f"ledger overshoot: {scheduled_tokens} tokens scheduled, "
            f"max_num_batched_tokens is {max_num_batched_tokens}"
        )
