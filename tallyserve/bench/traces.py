"""Trace files for `--workload file:PATH`.

JSONL, one request per line::

    {"arrival_s": 0.5, "conversation_id": "c1", "messages": [{"role": "user", "content": "hi"}],
     "max_tokens": 64}

  * exactly one of `prompt` (text), `prompt_token_ids` (list of ints) or `messages` (chat);
  * `max_tokens` (default --random-output-len), `arrival_s` (earliest send time; missing ones
    get Poisson arrivals at --request-rate), `request_id`, `think_time_s`;
  * lines with the same `conversation_id` are the turns of one conversation, in file order:
    each turn's `messages` (or `prompt`) are appended to the history, after the server's reply
    to the previous turn. Token-id prompts cannot form conversations (a reply is text).

ShareGPT JSON (a list of {"id", "conversations": [{"from": "human"|"gpt", "value": ...}]}):
every human message is a turn of that conversation; max_tokens is the word count of the gpt
reply that follows it (or --random-output-len).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tallyserve.bench.workloads import RequestSpec

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


def load_trace(path: str, limit: int, default_max_tokens: int) -> list[RequestSpec]:
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read trace {path!r}: {exc}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        specs = _from_sharegpt(data, limit, default_max_tokens, path)
    else:
        specs = _from_jsonl(text, limit, default_max_tokens, path)
    if not specs:
        raise ValueError(f"trace {path!r} holds no requests")
    multi = {s.conversation_id for s in specs if s.conversation_id is not None and s.turn > 0}
    for s in specs:
        if s.prompt_token_ids is not None and s.conversation_id in multi:
            raise ValueError(f"{path}: request {s.request_id!r}: prompt_token_ids cannot be used in a "
                             "multi-turn conversation (the reply is text); use prompt or messages")
    return specs


def _from_jsonl(text: str, limit: int, default_max_tokens: int, path: str) -> list[RequestSpec]:
    specs: list[RequestSpec] = []
    turns: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if len(specs) >= limit:
            break
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
        specs.append(_record_to_spec(rec, len(specs), turns, default_max_tokens, f"{path}:{lineno}"))
    return specs


def _record_to_spec(rec: dict, index: int, turns: dict[str, int], default_max_tokens: int, where: str) -> RequestSpec:
    present = [k for k in _PROMPT_KEYS if rec.get(k) is not None]
    if len(present) != 1:
        raise ValueError(f"{where}: needs exactly one of {', '.join(_PROMPT_KEYS)}, got {present or 'none'}")
    conv = rec.get("conversation_id")
    conv = None if conv is None else str(conv)
    turn = 0
    if conv is not None:
        turn = turns.get(conv, 0)
        turns[conv] = turn + 1
    max_tokens = rec.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    spec = RequestSpec(
        request_id=str(rec.get("request_id", f"trace-{index}")),
        max_tokens=max_tokens,
        arrival_s=_opt_float(rec.get("arrival_s"), "arrival_s", where),
        conversation_id=conv,
        turn=turn,
        think_time_s=_opt_float(rec.get("think_time_s"), "think_time_s", where) or 0.0,
    )
    value = rec[present[0]]
    if present[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: prompt must be a non-empty string")
        spec.prompt = value
    elif present[0] == "prompt_token_ids":
        if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ints >= 0")
        spec.prompt_token_ids = list(value)
    else:
        spec.messages = _check_messages(value, where)
    return spec


def _opt_float(value: Any, name: str, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{where}: {name} must be a number >= 0, got {value!r}")
    return float(value)


def _check_messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: each message needs string 'role' and 'content', got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _from_sharegpt(data: Any, limit: int, default_max_tokens: int, path: str) -> list[RequestSpec]:
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    specs: list[RequestSpec] = []
    for ci, entry in enumerate(data):
        msgs = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(msgs, list):
            raise ValueError(f"{path}: entry {ci} has no 'conversations' list")
        conv_id = str(entry.get("id", f"sharegpt-{ci}"))
        turn = 0
        for mi, msg in enumerate(msgs):
            if len(specs) >= limit:
                return specs
            if not isinstance(msg, dict) or msg.get("from") not in ("human", "user") or not msg.get("value"):
                continue
            reply = msgs[mi + 1] if mi + 1 < len(msgs) and isinstance(msgs[mi + 1], dict) else {}
            reply_words = len(str(reply.get("value", "")).split()) if reply.get("from") in ("gpt", "assistant") else 0
            specs.append(RequestSpec(
                request_id=f"{conv_id}-turn{turn}",
                max_tokens=max(1, reply_words) if reply_words else default_max_tokens,
                messages=[{"role": "user", "content": str(msg["value"])}],
                conversation_id=conv_id,
                turn=turn,
            ))
            turn += 1
    return specs
