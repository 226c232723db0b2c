"""The counters the scheduler and the engine core keep (what stats() and /metrics report)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class SchedulerStats:
    steps: int = 0
    scheduled_tokens: int = 0
    forward_tokens: int = 0
    ledger_violations: int = 0
    step_errors: int = 0
    prefix_hit_tokens: int = 0
    partial_hit_tokens: int = 0
    preemptions: int = 0
    host_hit_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0
    async_steps: int = 0  # steps scheduled while the previous one was still running
    deferred_admissions: int = 0  # a waiting request waited a step for a prefix block being computed

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def scheduler_snapshot(sched) -> dict:
    """Read-only counters and gauges of a Scheduler for stats(): the caller never touches the pool."""
    kv, host = sched.kv, sched.kv.host
    out: dict = sched.stats.as_dict()
    out.update(
        num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks,
        num_cached_blocks=kv.pool.num_cached_blocks, num_running=sched.num_running,
        num_waiting=sched.num_waiting, block_evictions=kv.pool.num_evictions,
        num_host_blocks=host.num_blocks if host else 0, host_blocks_offloaded=host.num_offloaded if host else 0,
        host_blocks_restored=sched.stats.host_hit_tokens // kv.block_size,
    )
    if sched.kv_xfer is not None:  # disaggregated serving: loads, failures, holds
        out.update(sched.kv_xfer.stats.as_dict(), kv_blocks_held_requests=sched.kv_xfer.num_held)
    return out
