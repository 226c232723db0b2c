"""Beam search through vLLM's extension fields: `use_beam_search`, `best_of` (the beam width,
default n) and `length_penalty`. One engine beam search group per prompt; its `n` best sequences
come back as a finished RequestOutput, so completions and chat build their responses (echo,
choice indexes, usage) exactly as for sampling. Like vLLM, beam search is not streamed."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Awaitable, Optional

from fastapi import Request

from tallyserve.engine.async_engine import EngineDeadError, RequestRejectedError, StepFailedError
from tallyserve.engine.beam_search import MAX_ABS_LENGTH_PENALTY, BeamSearchOutput, BeamSearchParams
from tallyserve.outputs import CompletionOutput, RequestOutput
from tallyserve.server.errors import bad_request, quote
from tallyserve.server.protocol import SamplingFields
from tallyserve.server.serving import ServerContext, check_unsupported, engine_errors, until_disconnect

MAX_BEAMS_PER_CHOICE = 64  # vLLM's limit on best_of / n


@dataclass(frozen=True)
class BeamSpec:
    """A validated beam search request; `params()` gives the engine's params for one prompt."""

    n: int
    beam_width: int
    max_tokens: Optional[int]  # None: up to max_model_len
    ignore_eos: bool
    length_penalty: float
    include_stop_str_in_output: bool

    def params(self, num_prompt_tokens: int, max_model_len: int) -> BeamSearchParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else max_model_len - num_prompt_tokens
        return BeamSearchParams(beam_width=self.beam_width, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)


def _unsupported(what: str, param: str) -> Exception:
    return bad_request(f"{what} is not supported with use_beam_search", param, "unsupported_parameter")


def beam_spec(req: SamplingFields, max_tokens: Optional[int], max_tokens_param: str, logprobs: bool) -> BeamSpec:
    """Check a request with use_beam_search=true; every combination beam search cannot serve is a 400."""
    check_unsupported(req)
    n = 1 if req.n is None else req.n
    if n < 1:
        raise bad_request(f"n must be at least 1, got {quote(n)}", "n")
    width = n if req.best_of is None else req.best_of
    if width < n:
        raise bad_request(f"best_of (the beam width) must be >= n, got best_of={quote(width)} and n={quote(n)}",
                          "best_of")
    if width > MAX_BEAMS_PER_CHOICE * n:
        raise bad_request(f"best_of (the beam width) may be at most {MAX_BEAMS_PER_CHOICE} times n, got "
                          f"best_of={quote(width)} and n={quote(n)}", "best_of")
    if req.stream:
        raise bad_request("stream=true is not supported with use_beam_search: beam search only knows its "
                          "best sequences when the search ends; send stream=false", "stream", "unsupported_parameter")
    if req.temperature not in (None, 0):
        raise bad_request(f"beam search is deterministic: temperature must be 0 or unset with use_beam_search, "
                          f"got {quote(req.temperature)}", "temperature")
    if logprobs:
        raise _unsupported("logprobs", "logprobs")
    if req.stop:
        raise bad_request("stop strings are not supported with use_beam_search: remove `stop` (beams end at "
                          "EOS or max_tokens)", "stop", "unsupported_parameter")
    if req.stop_token_ids:
        raise _unsupported("stop_token_ids", "stop_token_ids")
    if req.min_tokens:
        raise _unsupported("min_tokens", "min_tokens")
    penalty = 1.0 if req.length_penalty is None else req.length_penalty
    if not (math.isfinite(penalty) and abs(penalty) <= MAX_ABS_LENGTH_PENALTY):
        raise bad_request(f"length_penalty must be a finite number in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                          f"{MAX_ABS_LENGTH_PENALTY:g}], got {quote(penalty)}", "length_penalty")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {quote(max_tokens)}", max_tokens_param)
    return BeamSpec(n, width, max_tokens, bool(req.ignore_eos), float(penalty), bool(req.include_stop_str_in_output))


def check_beam_fits(ctx: ServerContext, spec: BeamSpec, num_prompt_tokens: int) -> None:
    """400 unless the KV cache holds the group when its beams diverge at once: the shared prompt
    plus, per beam, its generated blocks, its copied partial block and one being forked. (A fork
    that finds no free block fails the engine step, so the group must fit in an idle cache.)"""
    bs, total = ctx.engine.block_size, int(ctx.engine.stats().get("num_total_blocks", 0))
    max_tokens = spec.params(num_prompt_tokens, ctx.engine.max_model_len).max_tokens
    need = -(-num_prompt_tokens // bs) + spec.beam_width * (-(-max_tokens // bs) + 2)
    if need > total:
        raise bad_request(f"beam search with best_of={spec.beam_width} and max_tokens={max_tokens} may need "
                          f"{need} KV cache blocks, but the cache has {total}; lower best_of or max_tokens",
                          "best_of", "beam_search_too_large")


def to_request_output(out: BeamSearchOutput, prompt: Optional[str], ids: list[int], n: int) -> RequestOutput:
    """The n best sequences (best first) as a finished RequestOutput."""
    outputs = [CompletionOutput(index=i, text=seq.text or "", token_ids=list(seq.tokens[len(ids):]),
                                cumulative_logprob=seq.cum_logprob, logprobs=None, finish_reason=seq.finish_reason)
               for i, seq in enumerate(out.sequences[:n])]
    return RequestOutput(out.request_id, prompt, list(ids), outputs, finished=True)


async def _run_one(ctx: ServerContext, request_id: str, prompt: Optional[str], ids: list[int],
                   spec: BeamSpec) -> RequestOutput:
    """One beam search group, its metrics recorded however it ends."""
    tracker = ctx.metrics.tracker()
    try:
        params = spec.params(len(ids), ctx.engine.max_model_len)
        out = await ctx.engine.beam_search(request_id, {"prompt_token_ids": ids}, params)
    except (StepFailedError, EngineDeadError):
        tracker.finish("error")
        raise
    except RequestRejectedError:
        tracker.done = True  # never ran: a client error, not a finished request
        raise
    except BaseException:
        tracker.finish("abort")  # cancelled (client gone) or refused (queue full)
        raise
    result = to_request_output(out, prompt, ids, spec.n)
    tracker.observe(result, timed=False)
    tracker.finish()
    return result


async def _all(awaitables: list[Awaitable[RequestOutput]]) -> list[RequestOutput]:
    """Like gather, but the first failure (or a cancel) cancels the rest, so none keeps running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_beams(ctx: ServerContext, raw: Request, prompts: list[tuple[str, Optional[str], list[int]]],
                        spec: BeamSpec) -> list[RequestOutput]:
    """Run one group per (request id, prompt text, prompt ids); engine failures become API errors,
    a client that goes away cancels every group."""
    with engine_errors():
        return await until_disconnect(raw, _all([_run_one(ctx, rid, text, ids, spec) for rid, text, ids in prompts]))
