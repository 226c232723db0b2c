"""The KV connector interface (vLLM v1's split): a scheduler half in the engine process and a worker
half beside each KV cache (one per tensor-parallel rank).

Scheduler half: how many prompt tokens of a waiting request can be loaded remotely
(``get_num_new_matched_tokens``), told what was committed for them (``update_state_after_alloc``),
builds the workers' metadata from the step's frozen SchedulerOutput and nothing else
(``build_connector_meta``), and says whether a finished request's blocks stay pinned for a consumer
(``request_finished``). Worker half: ``register_kv_caches``, ``start_load_kv(meta)`` (asynchronous)
and ``get_finished()``: the loads done or failed, and the held requests whose KV a consumer has pulled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from tallyserve.config.kv_transfer import KVTransferConfig

if TYPE_CHECKING:
    import torch

    from tallyserve.core.sched_output import RemoteKVLoad, SchedulerOutput
    from tallyserve.request import Request


@dataclass(frozen=True)
class KVConnectorMetadata:
    """What the workers do this step: exactly the loads the step's SchedulerOutput committed."""

    loads: tuple["RemoteKVLoad", ...] = ()
    releases: tuple[dict, ...] = ()  # params of remote KV not needed after all: tell its producer

    def __bool__(self) -> bool:
        return bool(self.loads or self.releases)


@dataclass
class KVConnectorOutput:
    """From the workers: request ids whose load finished or failed (why), and producer-side
    request ids whose KV a consumer confirmed pulling. Bytes and seconds for the metrics."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)
    unknown_engine: set[str] = field(default_factory=set)  # failures because the remote engine is unknown
    finished_sending: set[str] = field(default_factory=set)
    bytes_received: int = 0
    load_seconds: float = 0.0

    def merge(self, other: "KVConnectorOutput") -> None:
        self.finished_recving |= other.finished_recving
        self.failed_recving.update(other.failed_recving)
        self.unknown_engine |= other.unknown_engine
        self.finished_sending |= other.finished_sending
        self.bytes_received += other.bytes_received
        self.load_seconds += other.load_seconds


class RankReports:
    """Merges the tensor-parallel ranks' reports: a request id is reported once every rank has
    reported it (failed if any rank failed), never earlier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._recv: dict[str, list] = {}  # rid -> [ranks reported, failure reason or None, unknown]
        self._send: dict[str, int] = {}

    def merge(self, outs: list[KVConnectorOutput]) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for out in outs:
            merged.bytes_received += out.bytes_received
            merged.load_seconds = max(merged.load_seconds, out.load_seconds)
            for rid in out.finished_recving | set(out.failed_recving):
                entry = self._recv.setdefault(rid, [0, None, False])
                entry[0] += 1
                if rid in out.failed_recving:
                    entry[1] = entry[1] or out.failed_recving[rid]
                    entry[2] = entry[2] or rid in out.unknown_engine
            for rid in out.finished_sending:
                self._send[rid] = self._send.get(rid, 0) + 1
        for rid in [r for r, e in self._recv.items() if e[0] >= self.world]:
            count, why, unknown = self._recv.pop(rid)
            if why is None:
                merged.finished_recving.add(rid)
            else:
                merged.failed_recving[rid] = why
                if unknown:
                    merged.unknown_engine.add(rid)
        for rid in [r for r, n in self._send.items() if n >= self.world]:
            del self._send[rid]
            merged.finished_sending.add(rid)
        return merged


class KVTransferParamsError(ValueError):
    """Malformed or stale kv_transfer_params (the server answers 400, param kv_transfer_params)."""


def _want(params: dict, key: str, kind, what: str):
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be {what}, got {value!r}")
    return value


def check_kv_transfer_params(params: Any, num_prompt_tokens: int, block_size: int,
                             now: Optional[float] = None) -> Optional[dict]:
    """Validate a request's kv_transfer_params; returns them (None when there is nothing to do).
    A consumer request (do_remote_prefill) must name the producer, its blocks (enough for the
    prompt, in this instance's block size) and must not be past the producer's hold deadline."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    for flag in ("do_remote_prefill", "do_remote_decode"):
        if not isinstance(params.get(flag, False), bool):
            raise KVTransferParamsError(f"kv_transfer_params.{flag} must be a bool, got {params[flag]!r}")
    if params.get("do_remote_prefill") and params.get("do_remote_decode"):
        raise KVTransferParamsError("kv_transfer_params: do_remote_prefill and do_remote_decode exclude each other")
    if not params.get("do_remote_prefill"):
        return dict(params)
    _want(params, "remote_engine_id", str, "a string")
    _want(params, "remote_request_id", str, "a string")
    _want(params, "remote_host", str, "a host name")
    port = _want(params, "remote_port", int, "a port number")
    if not 0 < port < 65536:
        raise KVTransferParamsError(f"kv_transfer_params.remote_port must be a port number, got {port!r}")
    ids = _want(params, "remote_block_ids", list, "a list of block ids")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in ids):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must hold non-negative ints")
    if params.get("block_size", block_size) != block_size:
        raise KVTransferParamsError(f"kv_transfer_params.block_size {params.get('block_size')!r} differs from this "
                                    f"instance's block_size {block_size}")
    needed = -(-(num_prompt_tokens - 1) // block_size)
    if len(ids) < needed:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has {len(ids)} blocks; the prompt's "
                                    f"KV needs {needed}: the params belong to another prompt")
    expires = params.get("expires_at")
    if expires is not None:
        if isinstance(expires, bool) or not isinstance(expires, (int, float)):
            raise KVTransferParamsError(f"kv_transfer_params.expires_at must be a number, got {expires!r}")
        if (time.time() if now is None else now) > expires:
            raise KVTransferParamsError("kv_transfer_params are stale: the producer no longer holds these blocks")
    return dict(params)


class KVConnectorBase:
    """Both halves; a connector object is built per role (engine process: scheduler half; each
    worker: worker half). The scheduler half's logic is shared by every transport."""

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = config.engine_id
        self.remote_host: Optional[str] = config.kv_ip
        self.remote_port: Optional[int] = config.kv_port

    def advertise(self, host: str, port: int) -> None:
        """The address consumers reach this instance at (the server's, unless kv_ip/kv_port say)."""
        self.remote_host = self.config.kv_ip or host
        self.remote_port = self.config.kv_port or port

    # ----------------------------------------------------------------- scheduler half
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Prompt tokens past ``num_computed_tokens`` (the local hit) that the remote engine holds;
        never the last prompt token (it is computed here and yields the first logits)."""
        params = request.kv_transfer_params or {}
        if not (self.config.is_consumer and params.get("do_remote_prefill")):
            return 0
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks were committed for ``num_external_tokens`` remote tokens (nothing to keep here:
        the load is listed in the SchedulerOutput, which is all ``build_connector_meta`` reads)."""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return KVConnectorMetadata(loads=scheduler_output.kv_loads, releases=scheduler_output.kv_releases)

    def request_finished(self, request: "Request", block_ids: Sequence[int]) -> tuple[bool, Optional[dict]]:
        """A producer request that ended normally keeps its blocks for the consumer: (True, the
        params the consumer needs). Anything else: (False, None)."""
        params = request.kv_transfer_params or {}
        if not (self.config.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status.finish_reason not in ("stop", "length") or not block_ids:
            return False, None
        hold = request.num_prompt_tokens > 1  # a one-token prompt has no KV for a consumer to pull
        return hold, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids), "remote_host": self.remote_host, "remote_port": self.remote_port,
            "block_size": self.block_size, "expires_at": time.time() + self.config.hold_timeout_s,
        }

    # ----------------------------------------------------------------- worker half
    def register_kv_caches(self, kv_caches: Sequence["torch.Tensor"]) -> None:
        """The per-layer caches, each (2, num_blocks, block_size, local kv heads, head_dim)."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start (asynchronously) every load of ``metadata``."""

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def shutdown(self) -> None:
        """Release transfer resources; idempotent."""
