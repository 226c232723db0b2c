"""KVTransferConfig: what `--kv-transfer-config` / `EngineArgs(kv_transfer_config=...)` takes.

Names follow vLLM so a deployment switches without relearning: ``kv_connector`` (``"NixlConnector"``),
``kv_role`` (``"kv_producer"`` for a prefill instance, ``"kv_consumer"`` for a decode instance,
``"kv_both"``), ``engine_id``, ``kv_ip``/``kv_port`` (the address the producer advertises in its
``kv_transfer_params``; default: the server's), ``kv_load_failure_policy`` and
``kv_connector_extra_config``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from tallyserve.config.parse import json_object_arg

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector", "FakeConnector")
FAILURE_POLICIES = ("recompute", "fail")


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"kv_transfer_config: {name} must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: Optional[str] = None
    kv_port: Optional[int] = None
    # A failed or timed-out load: compute the prompt locally ("recompute") or fail the request.
    kv_load_failure_policy: str = "recompute"
    # A remote engine this instance cannot reach or does not know: same choice.
    unknown_engine_policy: str = "recompute"
    load_timeout_s: float = 30.0  # a consumer gives up on a load after this long
    hold_timeout_s: float = 120.0  # a producer frees unclaimed blocks after this long
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: Any) -> Optional["KVTransferConfig"]:
        """None, a KVTransferConfig, a dict or its JSON text; ValueError naming the bad key."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object_arg("kv_transfer_config", value)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {sorted(known)}")
        cfg = dict(value)
        if cfg.get("kv_connector", "NixlConnector") not in CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of {CONNECTORS}, got {cfg['kv_connector']!r}")
        if cfg.get("kv_role", "kv_both") not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {KV_ROLES}, got {cfg['kv_role']!r}")
        for key in ("kv_load_failure_policy", "unknown_engine_policy"):
            if cfg.get(key, "recompute") not in FAILURE_POLICIES:
                raise ValueError(f"kv_transfer_config: {key} must be one of {FAILURE_POLICIES}, got {cfg[key]!r}")
        for key in ("load_timeout_s", "hold_timeout_s"):
            if key in cfg:
                cfg[key] = _positive(key, cfg[key])
        if "engine_id" in cfg and (not isinstance(cfg["engine_id"], str) or not cfg["engine_id"]):
            raise ValueError(f"kv_transfer_config: engine_id must be a non-empty string, got {cfg['engine_id']!r}")
        if cfg.get("kv_port") is not None:
            port = cfg["kv_port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"kv_transfer_config: kv_port must be a port number, got {port!r}")
        if not isinstance(cfg.get("kv_connector_extra_config", {}), dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        return cls(**cfg)
