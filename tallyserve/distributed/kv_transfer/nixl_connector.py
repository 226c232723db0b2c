"""The NIXL worker half: a consumer READs a producer's KV blocks straight from its registered memory.

Each rank's KV caches (one tensor per layer, (2, num_blocks, block_size, local kv heads, head_dim))
are registered with a NIXL agent (UCX backend): host memory on CPU, device memory on GPUs. A block
of one layer's K or V half is one contiguous run of ``block_bytes``, so a load is one descriptor per
(layer, K/V, run of blocks consecutive on both sides), posted as one READ request. The READ carries the producer's
request id as its notification: the producer learns the pull finished and frees its blocks.
With tensor parallelism every rank holds its own heads and reads the same rank of the producer.

Agent metadata (the NIXL blob plus the cache layout) travels over HTTP: the producer's server
answers ``GET /kv_transfer/metadata?rank=R``; a consumer fetches it once per remote engine, in
a background thread, so an unreachable producer never stalls the step loop.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from tallyserve.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from tallyserve.config.kv_transfer import KVTransferConfig

logger = logging.getLogger(__name__)

METADATA_PATH = "/kv_transfer/metadata"
HANDSHAKE_TIMEOUT_S = 5.0


def contiguous_runs(local: Sequence[int], remote: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Pair up blocks into runs that are consecutive on both sides: ([(local first, n)], [(remote first, n)]).
    A run is one contiguous span of memory per layer and K/V half on each side, so it is one descriptor
    instead of n (a per-descriptor cost dominates small blocks: 32 KiB per layer half on 8B shapes)."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks for {len(remote)} remote blocks")
    mine: list[tuple[int, int]] = []
    theirs: list[tuple[int, int]] = []
    for i, (a, b) in enumerate(zip(local, remote)):
        if i and a == local[i - 1] + 1 and b == remote[i - 1] + 1:
            mine[-1] = (mine[-1][0], mine[-1][1] + 1)
            theirs[-1] = (theirs[-1][0], theirs[-1][1] + 1)
        else:
            mine.append((a, 1))
            theirs.append((b, 1))
    return mine, theirs


# UCX moves GPU memory between processes of one node with CUDA IPC, but turns off its GET (what a
# consumer's READ is) on a GPU without active NVLink peers, e.g. prefill and decode sharing one card,
# and the READ then crawls through host TCP (about 0.5 GB/s). Turned on unless the user set it.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def load_nixl():
    """The NIXL agent classes (nixl-cu13 wheel); ImportError with the install line if absent."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)  # read by UCX when the agent creates its context
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ImportError("the NixlConnector needs NIXL: pip install --no-deps nixl-cu13==1.5.1") from exc
    return nixl_agent, nixl_agent_config


@dataclass
class _Remote:
    agent_name: str
    base_addrs: list[int]
    num_blocks: int
    block_bytes: int
    mem_type: str
    dev_id: int


@dataclass
class _Transfer:
    request_id: str
    handle: Any
    started: float
    nbytes: int


class NixlConnectorWorker(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, block_size: int, tp_rank: int = 0) -> None:
        super().__init__(config, block_size)
        nixl_agent, nixl_agent_config = load_nixl()
        self.tp_rank = tp_rank
        self.agent_name = f"{config.engine_id}-rank{tp_rank}"
        # NIXL's progress thread delivers the READs' notifications to the producer; it polls without
        # pause (about 40% of a core per idle instance on the CPU CI machine), the price of on-time frees.
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=["UCX"]))
        self._layout: Optional[_Remote] = None
        self._remotes: dict[str, _Remote] = {}  # engine id -> its rank's layout (agent added)
        self._handshakes: dict[str, Future] = {}  # engine id -> metadata being fetched
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nixl-handshake")
        self._queued: list[tuple[Any, float]] = []  # loads waiting for their engine's handshake
        self._releases: list[tuple[dict, float]] = []  # "not needed" notices waiting for a handshake
        self._transfers: list[_Transfer] = []
        self._out = KVConnectorOutput()

    # ----------------------------------------------------------------- registration
    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        first = kv_caches[0]
        if any(not t.is_contiguous() for t in kv_caches):
            raise ValueError("the NixlConnector needs contiguous KV cache tensors")
        self._caches = list(kv_caches)  # keep the registered memory alive
        self._kv_dtype = str(first.dtype).removeprefix("torch.")  # kv_cache_dtype="fp8": half the bytes per block
        self.agent.register_memory(self._caches)
        num_blocks = first.shape[1]
        block_bytes = first[0, 0].numel() * first.element_size()
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        dev = first.device.index or 0 if first.is_cuda else 0
        self._layout = _Remote(self.agent_name, [t.data_ptr() for t in kv_caches], num_blocks, block_bytes,
                               mem_type, dev)

    def metadata(self) -> dict:
        """What a consumer needs to read from this rank (served over HTTP as JSON)."""
        lay = self._layout
        return {"engine_id": self.engine_id, "tp_rank": self.tp_rank, "agent_name": self.agent_name,
                "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "base_addrs": lay.base_addrs, "num_blocks": lay.num_blocks, "block_bytes": lay.block_bytes,
                "block_size": self.block_size, "kv_cache_dtype": self._kv_dtype}

    def _descs(self, lay: _Remote, runs: Sequence[tuple[int, int]]):
        """One descriptor per (layer, K/V half, run of consecutive blocks): ``runs`` are (first block, count)."""
        rows = [(base + (half * lay.num_blocks + b) * lay.block_bytes, n * lay.block_bytes, lay.dev_id)
                for base in lay.base_addrs for half in (0, 1) for b, n in runs]
        return self.agent.get_xfer_descs(rows, self._layout.mem_type)

    # ----------------------------------------------------------------- handshake
    def _fetch(self, engine_id: str, host: str, port: int) -> _Remote:
        import httpx

        url = f"http://{host}:{port}{METADATA_PATH}"
        reply = httpx.get(url, params={"rank": self.tp_rank}, timeout=HANDSHAKE_TIMEOUT_S)
        reply.raise_for_status()
        meta = reply.json()
        if meta.get("engine_id") != engine_id:
            raise LookupError(f"{host}:{port} is engine {meta.get('engine_id')!r}, not {engine_id!r}")
        return self._add(meta)

    def add_remote(self, meta: dict) -> None:
        """Know a producer rank from its metadata() without asking its server (tests, static setups)."""
        self._remotes[meta["engine_id"]] = self._add(meta)

    def _add(self, meta: dict) -> _Remote:
        engine_id = meta.get("engine_id")
        if meta.get("kv_cache_dtype", self._kv_dtype) != self._kv_dtype:
            raise LookupError(f"engine {engine_id!r} caches K/V in {meta.get('kv_cache_dtype')}, this one in "
                              f"{self._kv_dtype}: prefill and decode instances need the same kv_cache_dtype")
        if meta.get("block_size") != self.block_size or meta.get("block_bytes") != self._layout.block_bytes \
                or len(meta.get("base_addrs", ())) != len(self._layout.base_addrs):
            raise LookupError(f"engine {engine_id!r} has another KV layout (block size, heads or layers)")
        name = self.agent.add_remote_agent(base64.b64decode(meta["agent_metadata"]))
        if isinstance(name, bytes):
            name = name.decode()
        return _Remote(name, list(meta["base_addrs"]), int(meta["num_blocks"]), int(meta["block_bytes"]),
                       self._layout.mem_type, 0)

    # ----------------------------------------------------------------- loads
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        now = time.monotonic()
        for load in metadata.loads:
            p = load.params
            engine = p["remote_engine_id"]
            if engine not in self._remotes and engine not in self._handshakes:
                self._handshakes[engine] = self._pool.submit(self._fetch, engine, p["remote_host"], p["remote_port"])
            self._queued.append((load, now))
        for params in metadata.releases:
            self._release(params, now)
        self._issue()

    def _release(self, params: dict, now: float) -> None:
        """Tell a producer its held KV is not needed (best effort: its hold timeout is the backstop)."""
        engine = params["remote_engine_id"]
        if engine not in self._remotes and engine not in self._handshakes:
            self._handshakes[engine] = self._pool.submit(self._fetch, engine, params["remote_host"], params["remote_port"])
        self._releases.append((params, now))

    def _send_releases(self) -> None:
        still = []
        for params, since in self._releases:
            remote = self._remotes.get(params["remote_engine_id"])
            if remote is not None:
                try:
                    self.agent.send_notif(remote.agent_name, params["remote_request_id"].encode())
                except Exception:  # noqa: BLE001 - best effort
                    logger.debug("release notification failed", exc_info=True)
            elif params["remote_engine_id"] in self._handshakes and time.monotonic() - since < self.config.load_timeout_s:
                still.append((params, since))
        self._releases = still

    def _resolve_handshakes(self) -> None:
        for engine, fut in list(self._handshakes.items()):
            if not fut.done():
                continue
            del self._handshakes[engine]
            try:
                self._remotes[engine] = fut.result()
            except Exception as exc:  # noqa: BLE001 - unreachable or unknown engine: the policy decides
                logger.warning("KV transfer: engine %s unreachable: %s", engine, exc)
                self._fail_engine(engine, f"remote engine {engine!r} is unknown or unreachable: {exc}")

    def _issue(self) -> None:
        self._resolve_handshakes()
        still = []
        for load, since in self._queued:
            engine = load.params["remote_engine_id"]
            if load.request_id in self._out.failed_recving:
                continue
            remote = self._remotes.get(engine)
            if remote is None:
                if time.monotonic() - since > self.config.load_timeout_s:
                    self._out.failed_recving[load.request_id] = "timed out waiting for the remote engine"
                    self._out.unknown_engine.add(load.request_id)
                else:
                    still.append((load, since))
                continue
            self._post(load, remote)
        self._queued = [(ld, s) for ld, s in still if ld.request_id not in self._out.failed_recving]
        self._send_releases()

    def _fail_engine(self, engine: str, why: str) -> None:
        for load, _ in self._queued:
            if load.params["remote_engine_id"] == engine:
                self._out.failed_recving[load.request_id] = why
                self._out.unknown_engine.add(load.request_id)

    def _post(self, load, remote: _Remote) -> None:
        if max(load.remote_block_ids, default=-1) >= remote.num_blocks:
            self._out.failed_recving[load.request_id] = "remote block ids out of range"
            return
        try:
            local_runs, far_runs = contiguous_runs(load.block_ids, load.remote_block_ids)
            local = self._descs(self._layout, local_runs)
            far = self._descs(remote, far_runs)
            handle = self.agent.initialize_xfer("READ", local, far, remote.agent_name,
                                                load.params["remote_request_id"].encode())
            state = self.agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - a transport error fails this load only
            self._out.failed_recving[load.request_id] = f"NIXL: {type(exc).__name__}: {exc}"
            return
        nbytes = 2 * len(remote.base_addrs) * len(load.block_ids) * remote.block_bytes
        t = _Transfer(load.request_id, handle, time.monotonic(), nbytes)
        if state == "ERR":
            self._finish(t, ok=False, why="NIXL transfer error")
        else:
            self._transfers.append(t)

    def _finish(self, t: _Transfer, ok: bool, why: str = "") -> None:
        try:
            self.agent.release_xfer_handle(t.handle)
        except Exception:  # noqa: BLE001 - a handle still in progress cannot always be released
            logger.debug("releasing a NIXL handle failed", exc_info=True)
        if ok:
            self._out.finished_recving.add(t.request_id)
            self._out.bytes_received += t.nbytes
            self._out.load_seconds += time.monotonic() - t.started
        else:
            self._out.failed_recving[t.request_id] = why

    def get_finished(self) -> KVConnectorOutput:
        self._issue()
        still = []
        for t in self._transfers:
            state = self.agent.check_xfer_state(t.handle)
            if state == "DONE":
                self._finish(t, ok=True)
            elif state == "ERR":
                self._finish(t, ok=False, why="NIXL transfer error (the producer may be gone)")
            elif time.monotonic() - t.started > self.config.load_timeout_s:
                self._finish(t, ok=False, why=f"transfer timed out after {self.config.load_timeout_s:.0f}s")
            else:
                still.append(t)
        self._transfers = still
        if self.config.is_producer:
            for msgs in self.agent.get_new_notifs().values():
                self._out.finished_sending.update(m.decode() for m in msgs)
        out, self._out = self._out, KVConnectorOutput()
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
