"""One streaming request against the public OpenAI API (/v1/completions, /v1/chat/completions).

Only what any OpenAI-compatible server speaks: `stream: true` with
`stream_options.include_usage`, server-sent events `data: {...}` ending with `data: [DONE]`.
Token counts come from the final usage chunk; times from the client's monotonic clock.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import httpx

from tallyserve.bench.metrics import RequestRecord


def api_root(base_url: str) -> str:
    """`http://host:port`, `http://host:port/` or `http://host:port/v1` -> `http://host:port/v1`."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def first_model_id(client: httpx.AsyncClient, root: str) -> str:
    try:
        resp = await client.get(f"{root}/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"cannot list models at {root}/models ({exc!r}); pass --model") from None
    if not data:
        raise ValueError(f"{root}/models lists no models; pass --model")
    return str(data[0]["id"])


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _finish_reason(chunk: dict) -> Optional[str]:
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def _read_usage(record: RequestRecord, usage: dict) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


async def _consume_stream(resp: httpx.Response, record: RequestRecord, chat: bool, t0: float, sent: float) -> None:
    parts: list[str] = []
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            record.error_kind, record.error = "bad_response", f"invalid JSON in stream: {data[:200]!r}"
            return
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"]
            record.error_kind = "server_error"
            record.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        text = _chunk_text(chunk, chat)
        # A completion chunk that does not finish its choice carries a token even with empty text
        # (a server without a tokenizer, or a partial UTF-8 character), and so does a finishing one
        # when nothing came before it (the whole answer in one chunk); a chat chunk counts with content.
        if text or (not chat and chunk.get("choices")
                    and (_finish_reason(chunk) is None or record.ttft_s is None)):
            if record.ttft_s is None:
                record.ttft_s = now - sent
            record.chunk_times_s.append(now - t0)
            parts.append(text)
        record.finish_reason = _finish_reason(chunk) or record.finish_reason
        if chunk.get("usage"):
            _read_usage(record, chunk["usage"])
    record.output_text = "".join(parts)
    if not done:
        record.error_kind, record.error = "incomplete_stream", "the stream ended without data: [DONE]"


async def send_request(client: httpx.AsyncClient, root: str, payload: dict[str, Any], record: RequestRecord,
                       t0: float) -> RequestRecord:
    """POST one streaming request and fill `record` (times relative to the run start `t0`)."""
    chat = "messages" in payload
    url = f"{root}/chat/completions" if chat else f"{root}/completions"
    sent = time.perf_counter()
    record.start_s = sent - t0
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                record.error_kind, record.error = f"http_{resp.status_code}", body[:500]
            else:
                await _consume_stream(resp, record, chat, t0, sent)
    except httpx.TimeoutException as exc:
        record.error_kind, record.error = "timeout", repr(exc)
    except httpx.ConnectError as exc:
        record.error_kind, record.error = "connect_error", repr(exc)
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        record.error_kind, record.error = "connection_lost", repr(exc)
    except httpx.HTTPError as exc:
        record.error_kind, record.error = "http_error", repr(exc)
    record.latency_s = time.perf_counter() - sent
    return record
