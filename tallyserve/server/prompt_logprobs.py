"""Prompt logprobs on the server (vLLM's ``prompt_logprobs`` field, and completions' ``echo`` with
``logprobs``): request checks, the vLLM response shape, and the legacy completions shape of the
echoed prompt (``null`` for its first token, which nothing predicts)."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from tallyserve.outputs import Logprob, PromptLogprobs, RequestOutput
from tallyserve.server.errors import bad_request, quote
from tallyserve.server.logprobs import completion_logprobs
from tallyserve.server.protocol import CompletionLogprobs, PromptLogprob
from tallyserve.tokenizer import Tokenizer

# JSON has no -inf: a token the model rules out entirely is reported with this logprob, as vLLM does.
MIN_LOGPROB = -9999.0


def check_prompt_logprobs(req: Any, max_logprobs: int) -> None:
    """400s for the request field prompt_logprobs (its type and sign are checked by SamplingParams)."""
    k = getattr(req, "prompt_logprobs", None)
    if k is None:
        return
    if req.stream:
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    if isinstance(k, int) and k > max_logprobs:
        raise bad_request(f"prompt_logprobs must be at most {max_logprobs} (the server's --max-logprobs), "
                          f"got {quote(k)}", "prompt_logprobs")


def _clamp(x: float) -> float:
    return x if not math.isinf(x) and not math.isnan(x) else MIN_LOGPROB


def prompt_logprobs_field(entries: Optional[PromptLogprobs], k: int) -> Optional[list]:
    """vLLM's response field: per prompt token null (the first) or token id -> {logprob, rank,
    decoded_token}, holding the prompt token and the k most likely tokens."""
    if entries is None:
        return None
    out: list[Optional[dict[int, PromptLogprob]]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        first = next(iter(entry))  # the prompt token comes first (engine/output_processor.py)
        out.append({tid: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
                    for tid, lp in entry.items() if tid == first or (lp.rank is not None and lp.rank <= k)})
    return out


def scored(out: RequestOutput) -> bool:
    """Whether every prompt token but the first has its logprobs (they arrive with the prefill chunks)."""
    entries = out.prompt_logprobs
    return entries is not None and all(e is not None for e in entries[1:])


def echo_logprobs(tokenizer: Optional[Tokenizer], prompt_ids: Sequence[int], entries: Optional[PromptLogprobs],
                  k: int) -> tuple[CompletionLogprobs, int]:
    """The legacy completions logprobs of an echoed prompt: its tokens, their logprobs (null for the
    first), their top-k (null first) and text offsets from 0; returns them and the offset after."""
    if entries is None or len(entries) != len(prompt_ids):
        raise ValueError("the prompt's logprobs are missing")
    first = prompt_ids[0]
    text = tokenizer.decode([first], skip_special_tokens=False) if tokenizer is not None else f"<token_id:{first}>"
    out = CompletionLogprobs(tokens=[text], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    rest, offset = completion_logprobs(tokenizer, prompt_ids[1:], [_clamped(e) for e in entries[1:]], k, len(text))
    extend(out, rest)
    return out, offset


def _clamped(entry: Optional[dict[int, Logprob]]) -> dict[int, Logprob]:
    if entry is None:
        raise ValueError("the prompt's logprobs are incomplete")
    return {tid: Logprob(_clamp(lp.logprob), lp.rank, lp.decoded_token) for tid, lp in entry.items()}


def extend(out: CompletionLogprobs, more: CompletionLogprobs) -> CompletionLogprobs:
    out.tokens.extend(more.tokens)
    out.token_logprobs.extend(more.token_logprobs)
    out.top_logprobs.extend(more.top_logprobs)
    out.text_offset.extend(more.text_offset)
    return out
