"""Disaggregated serving on the HTTP side: request kv_transfer_params (vLLM's name) checked into
400s, the producer's params added to its response, and the route consumers fetch NIXL agent
metadata from (GET /kv_transfer/metadata?rank=R)."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from tallyserve.distributed.kv_transfer.base import KVTransferParamsError
from tallyserve.outputs import RequestOutput
from tallyserve.server.errors import APIError, bad_request
from tallyserve.distributed.kv_transfer.factory import check_request_params

PARAM = "kv_transfer_params"


def check_params(ctx, params: Optional[dict], prompt_lengths: list[int], n: int) -> Optional[dict]:
    """The request's kv_transfer_params, validated for every prompt (400 naming the field)."""
    if params is None:
        return None
    if len(prompt_lengths) != 1:
        raise bad_request("kv_transfer_params apply to one prompt; send one prompt per request", PARAM)
    try:
        return check_request_params(ctx.engine.kv_connector, params, prompt_lengths[0], n)
    except KVTransferParamsError as exc:
        raise bad_request(str(exc), PARAM) from exc


def prompt_with_params(prompt: dict, params: Optional[dict]) -> dict:
    """The engine prompt dict, carrying the params to LLMEngine.add_request."""
    return prompt if params is None else {**prompt, PARAM: params}


def add_to_body(body: dict, outs: list[RequestOutput]) -> dict:
    """A producer's response carries what the consumer needs (top level, as vLLM's does)."""
    params = next((o.kv_transfer_params for o in outs if o.kv_transfer_params), None)
    if params is not None:
        body[PARAM] = params
    return body


def add_routes(app: FastAPI, ctx) -> None:
    @app.get("/kv_transfer/metadata")
    async def kv_transfer_metadata(rank: int = 0) -> JSONResponse:
        meta = ctx.engine.kv_transfer_metadata(rank)
        if meta is None:
            raise APIError(404, f"no NIXL KV connector for tensor-parallel rank {rank} here", "not_found_error",
                           "rank", None)
        return JSONResponse(meta)
