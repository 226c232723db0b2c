"""The scheduler's side of disaggregated serving: remote KV loads as one more kind of prefix hit.

A waiting request whose ``kv_transfer_params`` say ``do_remote_prefill`` first matches its own
prefix cache (device and host tier, whole blocks); the connector says how many of the remaining
prompt tokens the producer holds; blocks for the hit plus those tokens are committed at once
(ledger rule 2) and the request waits in WAITING_FOR_REMOTE_KVS, charging nothing. The load is
listed in the SchedulerOutput of that step (``kv_loads``) and the connector metadata is built from
that frozen output alone. When the workers report the load done, the request returns to the
waiting queue holding its blocks, with every prompt token but the last computed, and is then
scheduled like a request whose whole prompt was a prefix hit. A failed load recomputes locally or
fails the request (``kv_load_failure_policy``). A request ended while its load runs keeps its blocks
until the workers report that load, so nothing is written into a block someone else owns.

Producer side: a finished ``do_remote_decode`` request keeps its blocks pinned until a consumer
confirms the pull (``finished_sending``) or ``hold_timeout_s`` passes.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

from tallyserve.core import ledger
from tallyserve.core.kv_cache_manager import cdiv
from tallyserve.core.sched_output import RemoteKVLoad, SchedulerOutput
from tallyserve.distributed.kv_transfer.base import KVConnectorBase, KVConnectorOutput
from tallyserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from tallyserve.core.scheduler import Scheduler

REMOTE_NONE = -1  # not (or no longer) a remote load: the ordinary admission path
REMOTE_WAIT = -2  # cannot start now (no blocks, no budget, a sibling's load of the same KV runs)
REMOTE_LOADING = -3  # committed: the request left the waiting queue for WAITING_FOR_REMOTE_KVS
_MAX_DONE_KEYS = 65536


class KVTransferStats:
    def __init__(self) -> None:
        self.loads_started = 0
        self.loads_finished = 0
        self.load_failures = 0
        self.unknown_engine = 0
        self.loaded_tokens = 0
        self.bytes_received = 0
        self.load_seconds = 0.0
        self.sends_finished = 0
        self.holds_expired = 0
        self.loads_expired = 0  # waited past the producer's hold (minus a load's timeout): computed here
        self.loaded_dropped = 0  # loaded KV given back because the pool could not run the request

    def as_dict(self) -> dict:
        return {f"kv_{k}": v for k, v in vars(self).items()}


class RemoteKVScheduling:
    def __init__(self, connector: KVConnectorBase, scheduler: "Scheduler") -> None:
        self.connector = connector
        self.sched = scheduler
        self.kv = scheduler.kv
        self.stats = KVTransferStats()
        self._loading: dict[str, tuple[Request, tuple, int]] = {}  # rid -> (request, remote key, end)
        self._loading_keys: set[tuple] = set()
        self._done_keys: OrderedDict[tuple, None] = OrderedDict()  # loads that ended: siblings compute locally
        self._local: set[str] = set()  # fell back to local compute: never loaded remotely again
        self._ready: set[str] = set()  # loaded, holding their blocks, waiting to be scheduled
        self._orphans: dict[str, Request] = {}  # ended while their load runs: blocks freed when it reports
        self._held: dict[str, tuple[Request, float]] = {}  # producer: blocks pinned for a consumer
        self._step_loads: list[RemoteKVLoad] = []
        self._step_releases: list[dict] = []

    # ----------------------------------------------------------------- admission
    def admit_waiting(self, idx: int, budget: int, scheduled: dict[str, int]) -> Optional[int]:
        """The scheduler's hook for ``waiting[idx]``: None when it is no remote load (the ordinary
        path admits it); -1 when it must wait (admission stops, as for any request that does not fit);
        else the tokens charged: 0 when its load was committed (it left the queue for
        WAITING_FOR_REMOTE_KVS), n > 0 when its loaded KV lets it run now (it joins ``running``)."""
        sched = self.sched
        req = sched.waiting[idx]
        if req.kv_transfer_params is None:
            return None
        n = self.admit(req, budget, not sched.running and not scheduled)
        if n == REMOTE_NONE:
            return None
        if n == REMOTE_WAIT:
            return -1
        sched.waiting.pop(idx)
        if n == REMOTE_LOADING:
            return 0
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
        scheduled[req.request_id] = n
        return n

    def admit(self, req: Request, budget: int, alone: bool = False) -> int:
        """REMOTE_NONE, REMOTE_WAIT, REMOTE_LOADING, or the tokens to schedule now for a request
        whose load finished (its last prompt token, or a chunk of what is left). ``alone``: nothing
        runs or is scheduled, so no block will come back by waiting: a loaded request that still
        cannot get its blocks gives its loaded KV back (full blocks stay cached) and is admitted
        the ordinary way, so loaded requests never hold the pool hostage."""
        rid = req.request_id
        if rid in self._ready:
            needed = ledger.query_tokens(req.num_tokens, req.num_computed_tokens, len(req.spec_token_ids))
            n = ledger.charge(needed, budget, self.sched.config.enable_chunked_prefill)
            if n > 0 and self.kv.allocate_slots(req, n):
                self._ready.discard(rid)
                return n
            if not alone:
                return REMOTE_WAIT
            self._ready.discard(rid)
            self._local.add(rid)
            self.kv.free(req)
            req.num_computed_tokens = 0
            self.stats.loaded_dropped += 1
            return REMOTE_NONE
        params = req.kv_transfer_params
        if rid in self._local or not params.get("do_remote_prefill") or req.num_computed_tokens:
            return REMOTE_NONE
        key = (params["remote_engine_id"], params["remote_request_id"])
        if key in self._loading_keys:
            return REMOTE_WAIT  # a sibling (n > 1) loads this KV; it then hits the blocks cached here
        if key in self._done_keys:
            return REMOTE_NONE
        expires = params.get("expires_at")
        if expires is not None and time.time() > expires - self.connector.config.load_timeout_s:
            # The producer may free these blocks before a load started now could end: reading them
            # then could cache someone else's KV under this prompt's hashes. Compute it here instead.
            self._local.add(rid)
            self._remember_done(key)
            self.stats.loads_expired += 1
            return REMOTE_NONE
        hit = self.kv.match_prefix(req).without_partial()  # whole blocks: the load fills the rest
        ext = self.connector.get_num_new_matched_tokens(req, hit.num_tokens)
        if ext <= 0:  # the local cache has it all: the producer may let go now
            self._local.add(rid)
            self._remember_done(key)
            self._step_releases.append(dict(params))
            return REMOTE_NONE
        if not self.kv.allocate_slots(req, ext, hit):
            return REMOTE_WAIT
        host_tokens = len(hit.host_blocks) * self.kv.block_size
        self.sched.stats.prefix_hit_tokens += hit.num_full_tokens - host_tokens
        self.sched.stats.host_hit_tokens += host_tokens
        block_ids = self.kv.block_ids(rid)
        first, end = len(hit.blocks), hit.num_tokens + ext
        last = cdiv(end, self.kv.block_size)
        self._step_loads.append(RemoteKVLoad(rid, block_ids[first:last], tuple(params["remote_block_ids"][first:last]),
                                             hit.num_tokens, ext, dict(params)))
        self.connector.update_state_after_alloc(req, block_ids, ext)
        req.num_computed_tokens = hit.num_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = end
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[rid] = (req, key, end)
        self._loading_keys.add(key)
        self.stats.loads_started += 1
        return REMOTE_LOADING

    def release_ready(self) -> None:
        """Nothing runs or was scheduled: admission is blocked, and loaded requests waiting behind
        the blocked one would hold their blocks forever. They give them back (full blocks stay
        cached) and compute the rest locally. Not in a step that committed a load."""
        if self._step_loads or not self._ready:
            return
        for req in [r for r in self.sched.waiting if r.request_id in self._ready]:
            self._ready.discard(req.request_id)
            self._local.add(req.request_id)
            self.kv.free(req)
            req.num_computed_tokens = 0
            self.stats.loaded_dropped += 1

    def finish_output(self, so: SchedulerOutput) -> SchedulerOutput:
        """The end of ``schedule()``: the step's output gains the loads it committed (those still
        standing) and the releases it decided, then the connector metadata built from that final
        frozen output and nothing else. Also: a producer frees holds past their timeout, and when
        nothing runs, loaded requests blocked behind another give their blocks back."""
        import dataclasses

        self.expire_holds()
        if not so.requests and not self.sched.running:
            self.release_ready()
        so = dataclasses.replace(so, kv_loads=self.take_step_loads(), kv_releases=self.take_step_releases())
        return dataclasses.replace(so, kv_connector_metadata=self.connector.build_connector_meta(so))

    def take_step_releases(self) -> tuple[dict, ...]:
        releases, self._step_releases = tuple(self._step_releases), []
        return releases

    def take_step_loads(self) -> tuple[RemoteKVLoad, ...]:
        """The loads committed in this step that still stand (a request ended in the same step is
        not listed: its blocks were already freed and no worker is ever asked for it)."""
        loads, self._step_loads = self._step_loads, []
        return tuple(ld for ld in loads if ld.request_id in self._loading
                     and self._loading[ld.request_id][0].status == RequestStatus.WAITING_FOR_REMOTE_KVS)

    # ----------------------------------------------------------------- endings
    def on_finish(self, req: Request) -> bool:
        """Called as a request ends (status already set). True: its blocks stay (a load into them
        is running, or a consumer will pull them); the scheduler must not free them now."""
        rid = req.request_id
        self._ready.discard(rid)
        self._local.discard(rid)
        if rid in self._loading:
            _, key, _ = self._loading.pop(rid)
            self._loading_keys.discard(key)
            self._remember_done(key)
            if any(ld.request_id == rid for ld in self._step_loads):  # not issued yet: nobody writes there
                self._step_loads = [ld for ld in self._step_loads if ld.request_id != rid]
                return False
            self._orphans[rid] = req
            return True
        if req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"):
            hold, params = self.connector.request_finished(req, self.kv.block_ids(rid))
            req.kv_transfer_output = params
            if hold:
                self._held[rid] = (req, time.monotonic() + self.connector.config.hold_timeout_s)
                return True
        return False

    def _remember_done(self, key: tuple) -> None:
        self._done_keys[key] = None
        while len(self._done_keys) > _MAX_DONE_KEYS:
            self._done_keys.popitem(last=False)

    # ----------------------------------------------------------------- worker results
    def process(self, out: KVConnectorOutput) -> list[Request]:
        """Apply the workers' report; returns the requests failed by it (policy "fail")."""
        self.stats.bytes_received += out.bytes_received
        self.stats.load_seconds += out.load_seconds
        failed = []
        for rid in out.finished_recving:
            if self._free_orphan(rid) or rid not in self._loading:
                continue
            req, key, end = self._loading.pop(rid)
            self._loading_keys.discard(key)
            self._remember_done(key)
            req.num_computed_tokens = end
            self.kv.cache_blocks(req, end)
            self.stats.loads_finished += 1
            self.stats.loaded_tokens += end
            self._ready.add(rid)
            self._requeue(req)
        for rid, why in out.failed_recving.items():
            if self._free_orphan(rid) or rid not in self._loading:
                continue
            req, key, _ = self._loading.pop(rid)
            self._loading_keys.discard(key)
            self._remember_done(key)
            unknown = rid in out.unknown_engine
            self.stats.load_failures += 1
            self.stats.unknown_engine += unknown
            cfg = self.connector.config
            policy = cfg.unknown_engine_policy if unknown else cfg.kv_load_failure_policy
            if policy == "fail":
                req.error = f"KVTransferError: loading the prompt's KV failed: {why}"
                self.sched.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                failed.append(req)
                continue
            self.kv.free(req)
            req.num_computed_tokens = 0
            self._local.add(rid)
            self._requeue(req)
        for rid in out.finished_sending:
            entry = self._held.pop(rid, None)
            if entry is not None:
                self.kv.free(entry[0])
                self.stats.sends_finished += 1
        return failed

    def _free_orphan(self, rid: str) -> bool:
        req = self._orphans.pop(rid, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def _requeue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.sched.waiting, req, key=lambda r: r.sort_key)

    def expire_holds(self, now: Optional[float] = None) -> None:
        """Producer: free blocks no consumer claimed within hold_timeout_s."""
        if not self._held:
            return
        now = time.monotonic() if now is None else now
        for rid in [rid for rid, (_, deadline) in self._held.items() if deadline <= now]:
            req, _ = self._held.pop(rid)
            self.kv.free(req)
            self.stats.holds_expired += 1

    def has_pending(self) -> bool:
        """Blocks that still wait for a worker or a consumer (the engine keeps stepping)."""
        return bool(self._loading or self._orphans or self._held)

    @property
    def num_held(self) -> int:
        return len(self._held)
