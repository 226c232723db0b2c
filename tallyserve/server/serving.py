"""What completions and chat completions share: admission checks, sampling params, tokenization
off the event loop, prompt checks, running engine requests (with metrics, merging and
client-disconnect handling). Streaming responses are in `sse.py`."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, TypeVar

from fastapi import Request

from tallyserve.config import ContextLengthError
from tallyserve.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError, RequestRejectedError,
                                            StepFailedError)
from tallyserve.engine.input_processor import InputError
from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.server import errors, fields
from tallyserve.server.errors import APIError, bad_request, quote
from tallyserve.server.metrics import RequestTracker, ServerMetrics
from tallyserve.server.prompt_logprobs import check_prompt_logprobs
from tallyserve.server.protocol import SamplingFields
from tallyserve.server.structured import CONSTRAINT_FIELD, check_compiles, structured_outputs_of

logger = logging.getLogger(__name__)
MAX_N = 128  # OpenAI's limit on n
INLINE_TOKENIZE_CHARS = 4000  # smaller texts are tokenized on the event loop; larger ones on a thread
T = TypeVar("T")


@dataclass
class ServerContext:
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    served_model_name: str
    api_key: Optional[str] = None
    enable_fault_injection: bool = False
    trust_request_chat_template: bool = False  # render a chat_template sent in a request (vLLM's flag)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses outputs with tool_parser (vLLM's flags)
    tool_parser: Optional[str] = None
    # One worker with its own tokenizer copy: no tokenizer object is ever used by two threads.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tallyserve-tokenize"))
    pool_tokenizer: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.pool_tokenizer is None and self.engine.tokenizer is not None:
            self.pool_tokenizer = copy.deepcopy(self.engine.tokenizer)

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


class ClientDisconnected(Exception):
    pass


# ----------------------------------------------------------------------------- admission


def check_model(ctx: ServerContext, model: Optional[str]) -> None:
    if model is not None and model != ctx.served_model_name:
        raise APIError(404, f"The model {quote(model)} does not exist. This server serves "
                       f"{quote(ctx.served_model_name)}.", errors.INVALID_REQUEST, "model", "model_not_found")


def check_admission(ctx: ServerContext) -> None:
    """503 while draining or with a dead loop; 429 when the waiting queue is full."""
    engine = ctx.engine
    if engine.draining:
        raise errors.unavailable("the server is shutting down and accepts no new requests", "draining")
    if not engine.is_running:
        raise errors.unavailable(engine.health().reason, "engine_dead")
    if engine.max_queue_len is not None and engine.num_waiting() >= engine.max_queue_len:
        raise errors.rate_limited(f"too many requests waiting (max_queue_len is {engine.max_queue_len}); "
                                  "retry later")


_logged_unknown: set[str] = set()
MAX_LOGGED_UNKNOWN = 256  # distinct unknown field names logged per process; then one last line


def check_fields(req: SamplingFields) -> None:
    """The field catalogue's rule (fields.py): an OpenAI or vLLM field tallyserve does not
    implement is a 400 ("unsupported_parameter", param = the field) unless absent, null or one of
    its harmless values; a field neither API defines is ignored, logged once per name."""
    catalogue = fields.CATALOGUES.get(req.catalogue, {})
    declared = type(req).model_fields
    for name in req.model_fields_set:
        if name not in declared:
            continue
        info = catalogue.get(name)
        if info is not None and info.status == fields.UNSUPPORTED and not info.accepts(getattr(req, name)):
            raise _unsupported_field(name, info)
    for name, value in (req.model_extra or {}).items():
        info = catalogue.get(name)
        if info is None:
            _log_unknown(name, req.catalogue)
        elif not info.accepts(value):
            raise _unsupported_field(name, info)
    so = req.stream_options
    if so is not None and so.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported by tallyserve (usage comes "
                          "only in the last chunk, with include_usage); omit it or send false",
                          "stream_options.continuous_usage_stats", "unsupported_parameter")


def _unsupported_field(name: str, info: "fields.FieldInfo") -> APIError:
    return bad_request(f"{name} is not supported by tallyserve: {info.reason}; omit it or send "
                       f"{info.harmless_text()}", name, "unsupported_parameter")


def _log_unknown(name: str, endpoint: str) -> None:
    if name in _logged_unknown or len(_logged_unknown) > MAX_LOGGED_UNKNOWN:
        return
    _logged_unknown.add(name)
    if len(_logged_unknown) > MAX_LOGGED_UNKNOWN:
        logger.warning("more than %d distinct unknown request fields: no longer logging them", MAX_LOGGED_UNKNOWN)
        return
    logger.warning("ignoring request field %s of %s: not an OpenAI or vLLM parameter", quote(name, 80), endpoint)


def check_unsupported(req: SamplingFields) -> None:
    """400 for the OpenAI and vLLM options tallyserve does not implement (check_fields; and
    penalties and token controls with beam search)."""
    check_fields(req)
    if req.use_beam_search:
        for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("logit_bias", {}), ("allowed_token_ids", None), ("bad_words", []),
                          ("prompt_logprobs", None)):
            if getattr(req, name, None) not in (None, off):
                raise bad_request(f"{name} is not supported with use_beam_search", name, "unsupported_parameter")
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {quote(n)}", "n")
    structured_outputs_of(req)  # a malformed or doubled constraint, or one with beam search: 400


def sampling_params(req: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                    max_tokens_param: str = "max_tokens", ctx: Optional[ServerContext] = None) -> SamplingParams:
    """``ctx``: for the vocabulary check of token ids and the tokenization of bad_words."""
    check_unsupported(req)
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise bad_request("best_of other than n is only supported with use_beam_search (sampling returns "
                          "every sequence it draws)", "best_of", "unsupported_parameter")
    kwargs: dict[str, Any] = dict(
        n=n, temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0),
        top_k=_default(req.top_k, 0), min_p=_default(req.min_p, 0.0), seed=req.seed,
        max_tokens=max_tokens, min_tokens=_default(req.min_tokens, 0), stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=_default(req.ignore_eos, False), logprobs=logprobs,
        skip_special_tokens=_default(req.skip_special_tokens, True),
        include_stop_str_in_output=_default(req.include_stop_str_in_output, False),
        presence_penalty=_default(req.presence_penalty, 0.0), frequency_penalty=_default(req.frequency_penalty, 0.0),
        repetition_penalty=_default(req.repetition_penalty, 1.0), logit_bias=req.logit_bias or None,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, prompt_logprobs=req.prompt_logprobs,
    )
    kwargs["structured_outputs"], constraint_field = structured_outputs_of(req)
    CONSTRAINT_FIELD.set(constraint_field)  # names the field if its grammar does not compile
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        field = msg.split(" ", 1)[0].split("[", 1)[0]
        if field == "max_tokens":
            msg, field = msg.replace("max_tokens", max_tokens_param, 1), max_tokens_param
        raise bad_request(msg, field if field in kwargs or field == max_tokens_param else None) from exc
    if ctx is not None:
        check_prompt_logprobs(req, ctx.engine.max_logprobs)
        try:  # the engine's own checks (vocabulary ranges, logprob caps, n, bad words tokenized), in one place
            params = ctx.engine.input_processor.check_params(params)
        except InputError as exc:
            raise bad_request(str(exc), exc.param) from exc
    return params


def _default(value: Optional[T], default: T) -> T:
    return default if value is None else value


def check_prompt_ids(ctx: ServerContext, ids: list[int], params: Any, param: str) -> None:
    """Length and range checks, so bad prompts are a 400 before they reach the engine. `params`:
    anything with `max_tokens` (SamplingParams, or beam search's BeamSpec)."""
    if not ids:
        raise bad_request("the prompt must not be empty", param)
    checks = ctx.engine.input_processor
    try:  # length first: cheap, and it bounds the range scan below
        checks.check_prompt_length(len(ids))
    except ContextLengthError as exc:
        raise bad_request(str(exc), param, "context_length_exceeded") from exc
    try:
        checks.check_token_ids(ids, param)
    except InputError as exc:
        raise bad_request(str(exc), param) from exc
    try:
        checks.check_prompt_length(len(ids), params.max_tokens)
    except ContextLengthError as exc:
        raise bad_request(str(exc), "max_tokens", "context_length_exceeded") from exc


def text_size(value: Any) -> int:
    """Characters in all the strings of a JSON value (the cost of tokenizing it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value if isinstance(v, (str, list, tuple, dict)))
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    return 0


async def tokenize(ctx: ServerContext, size: int, fn: Callable[[Any], T]) -> T:
    """`fn(tokenizer)` (an encode or a chat template): inline for up to INLINE_TOKENIZE_CHARS
    characters of input (`size`), else on the server's one tokenizer thread with that thread's own
    tokenizer copy, so a megabyte prompt never blocks the event loop (and so /health)."""
    if size <= INLINE_TOKENIZE_CHARS or ctx.pool_tokenizer is None:
        return fn(ctx.engine.tokenizer)
    return await asyncio.get_running_loop().run_in_executor(ctx.tokenize_pool, fn, ctx.pool_tokenizer)


# ----------------------------------------------------------------------------- running


def tracked(ctx: ServerContext, request_id: str, prompt: dict, params: SamplingParams
            ) -> AsyncIterator[RequestOutput]:
    """One engine request, its metrics recorded however it ends: its tracker is made now, so a
    stream that is never iterated (its client left before the response started) is still counted,
    as an abort, when the request scope ends (metrics.request_scope)."""
    return _tracked(ctx, ctx.metrics.tracker(), request_id, prompt, params)


async def _tracked(ctx: ServerContext, tracker: RequestTracker, request_id: str, prompt: dict,
                   params: SamplingParams) -> AsyncIterator[RequestOutput]:
    try:
        try:
            await check_compiles(ctx.engine, params)  # a grammar that does not compile: 400 before any output
        except APIError:
            tracker.discard()  # never ran: the client gets the 400
            raise
        gen = ctx.engine.generate(request_id, prompt, params)
        try:
            async for out in gen:
                tracker.observe(out)
                yield out
        finally:
            await gen.aclose()  # aborts the request if it is still running
    except (StepFailedError, EngineDeadError):
        tracker.finish("error")
        raise
    except RequestRejectedError:
        tracker.discard()  # never ran: a client error, not a finished request
        raise
    finally:
        tracker.close()


async def merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the index of their request.
    Closing this iterator closes (and so aborts) every request still running. Bounded: a consumer
    that stops reading holds at most len(gens) outputs here; the engine's streams coalesce the rest."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue(maxsize=len(gens))

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await q.put((i, out, None))  # blocks while the consumer is behind: the stream coalesces
            await q.put((i, None, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            await q.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await q.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def until_disconnect(raw: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(raw: Request, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run requests to the end (non-streaming); map engine failures to API errors."""
    async def run() -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async for i, out in merged(gens):
            final[i] = out
        return [final[i] for i in range(len(gens))]
    with engine_errors():
        return await until_disconnect(raw, run())


async def prime(raw: Request, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item before the response starts, so a rejected request still gets a
    proper status; a step failure at this point is left to the stream (an error event). The result
    closes `stream` when it is closed, iterated or not (pass it to SSEResponse as its source)."""
    try:
        with engine_errors(step_failures=False):
            first = await until_disconnect(raw, stream.__anext__())
    except StopAsyncIteration:
        return _empty()
    except StepFailedError as exc:
        return _raise_later(exc)
    return Primed(first, stream)


async def _empty() -> AsyncIterator:
    return
    yield  # pragma: no cover


async def _raise_later(exc: BaseException) -> AsyncIterator:
    raise exc
    yield  # pragma: no cover


class Primed(AsyncIterator[T]):
    """`first`, then the items of `rest`. Unlike an async generator, aclose() closes `rest` even
    when this was never iterated (the response's body never started: its client left first)."""

    def __init__(self, first: T, rest: AsyncIterator[T]) -> None:
        self._first: list[T] = [first]
        self._rest = rest

    async def __anext__(self) -> T:
        if self._first:
            return self._first.pop()
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        self._first.clear()
        await self._rest.aclose()


@contextlib.contextmanager
def engine_errors(step_failures: bool = True) -> Iterator[None]:
    """Engine exceptions -> APIError: rejected 400, step failure 500, dead loop 503."""
    try:
        yield
    except RequestRejectedError as exc:
        raise bad_request(str(exc)) from exc
    except EngineDeadError as exc:
        raise errors.unavailable(str(exc), "engine_dead") from exc
    except QueueFullError as exc:
        raise errors.rate_limited(f"{exc}; retry later") from exc
    except StepFailedError as exc:
        if not step_failures:
            raise
        if str(exc).startswith("KVTransferError"):  # the producer's KV could not be pulled (policy "fail")
            raise errors.unavailable(f"{exc}; retry the request", "kv_transfer_failed") from exc
        raise errors.step_failed(str(exc)) from exc
