"""Building a connector from a KVTransferConfig, and the engine's check of a request's params."""

from __future__ import annotations

from typing import Any, Optional

from tallyserve.distributed.kv_transfer.base import KVConnectorBase, KVTransferParamsError, check_kv_transfer_params
from tallyserve.config.kv_transfer import KVTransferConfig


def make_connector(config: KVTransferConfig, block_size: int, role: str) -> KVConnectorBase:
    """``role``: "scheduler" (the engine process) or "worker" (beside a KV cache)."""
    if config.kv_connector == "NixlConnector":
        if role == "scheduler":
            return KVConnectorBase(config, block_size)  # the scheduler half is transport-independent
        from tallyserve.distributed.kv_transfer.nixl_connector import NixlConnectorWorker

        return NixlConnectorWorker(config, block_size)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}")


def check_request_params(connector: Optional[KVConnectorBase], params: Any, num_prompt_tokens: int,
                         n: int) -> Optional[dict]:
    """A request's kv_transfer_params, validated against this engine (KVTransferParamsError, a
    ValueError, names what is wrong: the server answers 400)."""
    if params is None or (isinstance(params, dict) and not params.get("do_remote_prefill")
                          and not params.get("do_remote_decode")):
        return None  # nothing to transfer ({} or both flags false): any engine accepts it
    if connector is None:
        raise KVTransferParamsError("kv_transfer_params need an engine started with kv_transfer_config")
    checked = check_kv_transfer_params(params, num_prompt_tokens, connector.block_size)
    cfg = connector.config
    if checked.get("do_remote_prefill") and not cfg.is_consumer:
        raise KVTransferParamsError(f"kv_transfer_params.do_remote_prefill needs kv_role kv_consumer or kv_both, "
                                    f"this engine is {cfg.kv_role}")
    if checked.get("do_remote_decode"):
        if not cfg.is_producer:
            raise KVTransferParamsError(f"kv_transfer_params.do_remote_decode needs kv_role kv_producer or kv_both, "
                                        f"this engine is {cfg.kv_role}")
        if n != 1:
            raise KVTransferParamsError("kv_transfer_params.do_remote_decode needs n=1 (the consumer samples the n "
                                        "completions from one prefill)")
    return checked
