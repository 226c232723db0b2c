"""Structured outputs in the OpenAI-compatible API: the request fields that ask for a constraint,
mapped to one StructuredOutputsParams, and the grammar compiled before a response starts.

Fields (vLLM's names): ``response_format`` {"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}; ``structured_outputs`` (an object with json, regex,
choice, grammar, json_object, structural_tag, disable_any_whitespace, ...); the older
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structural_tag``;
``guided_decoding_backend`` naming "xgrammar" or "auto" (xgrammar takes no whitespace pattern, so
``guided_whitespace_pattern`` stays a 400 naming it). More
than one constraint in a request is a 400, as is any that does not compile (naming the field).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from dataclasses import fields as dc_fields
from typing import Any, Optional

from tallyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tallyserve.server.errors import bad_request, quote, rate_limited, unavailable
from tallyserve.structured_output.compile_pool import CompileCancelledError, CompileQueueFullError
from tallyserve.structured_output.compiler import GrammarKey

BACKENDS = ("xgrammar", "auto")
# The request field a handler's constraint came from, for the 400 of a grammar that does not compile.
CONSTRAINT_FIELD: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("constraint_field", default=None)

_SO_KEYS = {f.name for f in dc_fields(StructuredOutputsParams)}


def _from_response_format(rf: Any) -> Optional[dict]:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        if set(rf) - {"type"}:
            raise bad_request(f'response_format of type "text" takes no other keys, got {sorted(set(rf) - {"type"})}',
                              "response_format")
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request('response_format of type "json_schema" needs a json_schema object '
                              '({"name", "schema", "strict"})', "response_format")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in rf.items()})}
    raise bad_request(f'response_format.type must be "text", "json_object" or "json_schema", got {quote(kind)}',
                      "response_format")


def _guided(req: Any) -> list[tuple[str, dict]]:
    found = []
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar"), ("structural_tag", "structural_tag")):
        value = getattr(req, name, None)
        if value is None:
            continue
        if name == "structural_tag" and isinstance(value, dict):
            value = json.dumps(value)
        found.append((name, {key: value}))
    return found


def structured_outputs_of(req: Any) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's constraint and the field it came from (None, None without one); 400s for a
    malformed one, for more than one, and for a backend other than xgrammar."""
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None and backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend must be one of {list(BACKENDS)} (tallyserve uses xgrammar), "
                          f"got {quote(backend)}", "guided_decoding_backend")
    found: list[tuple[str, dict]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _from_response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(so) - _SO_KEYS)
        if unknown:
            raise bad_request(f"structured_outputs has unknown keys {unknown}; known: {sorted(_SO_KEYS)}",
                              "structured_outputs")
        found.append(("structured_outputs", dict(so)))
    found += _guided(req)
    if not found:
        return None, None
    if len(found) > 1:
        names = [n for n, _ in found]
        raise bad_request(f"a request takes one output constraint; got {', '.join(names)}", names[1])
    field, spec = found[0]
    if getattr(req, "use_beam_search", False):
        raise bad_request("structured outputs are not supported with use_beam_search", field)
    try:
        params = StructuredOutputsParams(**spec)

        GrammarKey.of(params)  # cheap checks (JSON of the schema, whitespace_pattern) before compiling
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field) from exc
    except TypeError as exc:
        raise bad_request(f"{field}: {exc}", field) from exc
    return params, field


async def check_compiles(engine: Any, params: SamplingParams) -> None:
    """Compile the request's grammar before the request is accepted (in the compile pool's
    worker processes; the engine finds it in its cache when the request is added): a 400 naming
    the field if it is over a limit, uses what the backend cannot enforce, does not compile or
    does not compile in time; a 429 when too many compiles wait. A caller cancelled while it
    waits (its client left) gives up its claim, and a compile nobody else waits for is killed.
    ``engine``: the AsyncLLMEngine."""
    so = params.structured_outputs
    if so is None:
        return
    manager = engine.structured  # thread-safe; nothing here blocks the event loop
    try:
        ticket = manager.submit(so)
    except ValueError as exc:
        raise bad_request(str(exc), CONSTRAINT_FIELD.get() or "structured_outputs") from exc
    except CompileQueueFullError as exc:
        raise rate_limited(f"{exc}; retry later") from exc
    loop = asyncio.get_running_loop()
    done = loop.create_future()  # this waiter's own: cancelling it leaves the shared compile alone
    ticket.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(
        lambda: done.done() or done.set_result(None)))
    try:
        await done
    finally:
        manager.release(ticket)  # also when cancelled: the compile stops if nobody else waits
    try:
        manager.result(ticket)
    except ValueError as exc:
        raise bad_request(str(exc), CONSTRAINT_FIELD.get() or "structured_outputs") from exc
    except CompileCancelledError as exc:
        raise unavailable(f"the grammar compile was cancelled ({exc}): the server is shutting down",
                          "shutting_down") from exc
