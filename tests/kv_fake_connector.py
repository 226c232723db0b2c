"""An in-process KV connector for scheduler tests, beside the model-free oracle runner.

The "producer" holds each remote request's prompt; a load writes those token ids into the oracle's
KV slots of the local blocks (as a real transfer writes KV), completing in a random order, some
loads failing. Every load the workers are asked for is checked against the scheduler's own state
(the filtered batch): the request must be WAITING_FOR_REMOTE_KVS right now, with exactly these
blocks, and must never have been asked for before.
"""

from __future__ import annotations

import random

from tallyserve.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from tallyserve.config.kv_transfer import KVTransferConfig
from tallyserve.request import RequestStatus


def remote_params(remote_request_id: str, num_prompt_tokens: int, block_size: int, engine: str = "producer") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": engine, "remote_request_id": remote_request_id,
            "remote_block_ids": list(range(1000, 1000 + -(-num_prompt_tokens // block_size))),
            "remote_host": "127.0.0.1", "remote_port": 1, "block_size": block_size}


class FakeConnector(KVConnectorBase):
    """Scheduler half: the shared logic. Worker half: writes the producer's prompt into the oracle."""

    def __init__(self, block_size: int, policy: str = "recompute", seed: int = 0, fail_rate: float = 0.0,
                 finish_rate: float = 0.5) -> None:
        super().__init__(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", engine_id="consumer",
                                          kv_load_failure_policy=policy, unknown_engine_policy=policy), block_size)
        self.rng = random.Random(seed)
        self.fail_rate = fail_rate
        self.finish_rate = finish_rate
        self.scheduler = None  # set by the test: the filtered-batch checks read its state
        self.runner = None  # the OracleRunner whose cache the loads write
        self.prompts: dict[str, list[int]] = {}  # remote request id -> the producer's prompt
        self.pending: dict[str, tuple] = {}
        self.asked: list[str] = []  # every request id a load was started for, in order
        self.metas: list[KVConnectorMetadata] = []

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self.metas.append(metadata)
        for load in metadata.loads:
            rid = load.request_id
            assert rid not in self.asked, f"{rid}: a load was asked for twice"
            req = self.scheduler.requests.get(rid)
            assert req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, \
                f"{rid}: asked to load for a request that is not waiting for remote KV ({req})"
            held = self.scheduler.kv.block_ids(rid)
            first = load.start_position // self.block_size
            assert held[first:first + len(load.block_ids)] == load.block_ids, (rid, held, load)
            assert len(load.remote_block_ids) == len(load.block_ids)
            self.asked.append(rid)
            self.pending[rid] = load

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid in sorted(self.pending):
            if self.rng.random() >= self.finish_rate:
                continue  # still running: completion order is random
            load = self.pending.pop(rid)
            if self.rng.random() < self.fail_rate:
                out.failed_recving[rid] = "injected transfer failure"
                continue
            prompt = self.prompts[load.params["remote_request_id"]]
            bs = self.block_size
            for pos in range(load.start_position, load.start_position + load.num_tokens):
                block = load.block_ids[pos // bs - load.start_position // bs]
                self.runner.cache[block * bs + pos % bs] = prompt[pos]
            out.finished_recving.add(rid)
            out.bytes_received += load.num_tokens
        return out

    def finish_all(self) -> KVConnectorOutput:
        rate, self.finish_rate = self.finish_rate, 1.0
        try:
            return self.get_finished()
        finally:
            self.finish_rate = rate
