"""Grammar compilation for structured outputs (xgrammar), cached per (kind, spec, options).

Compilation runs on a small thread pool, never on the step loop: ``submit`` returns a future
the engine polls, and a second request with the same constraint shares the first one's future
(then its compiled grammar). A constraint that does not compile raises ``ValueError`` naming
the field (structured_outputs.json, .regex, ...), never anything the server would turn into a 500.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from tallyserve.config import json_object_arg
from tallyserve.sampling_params import StructuredOutputsParams

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarKey(tuple):
    """(kind, canonical spec, options): what a compiled grammar is cached under."""

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> "GrammarKey":
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend: "
                             "use disable_any_whitespace for compact JSON")
        if kind == "json":
            spec = json_object_arg("structured_outputs.json", params.json, "a JSON schema object")
            text = json.dumps(spec, sort_keys=True, ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(list(params.choice), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(params, kind)
        return cls((kind, text, bool(params.disable_any_whitespace)))

    @property
    def kind(self) -> str:
        return self[0]


def _clean(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = _XGR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return msg[:500]


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile_structural_tag(compiler: Any, spec: str) -> Any:
    """A structural tag: xgrammar's format ({"type": "structural_tag", "format": ...}) or the
    earlier one with "structures" (begin, schema, end) and "triggers"."""
    import xgrammar as xgr

    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, list(tag.get("triggers", [])))
    return compiler.compile_structural_tag(spec)


COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class CompileStats:
    """Counters the server exports (tallyserve_structured_output_*)."""

    requests: dict[str, int] = field(default_factory=dict)  # structured-output requests by kind
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    compile_seconds_sum: float = 0.0
    compile_bucket_counts: list[int] = field(default_factory=lambda: [0] * len(COMPILE_BUCKETS))

    def count_request(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def observe_compile(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds_sum += seconds
        for i, bound in enumerate(COMPILE_BUCKETS):
            if seconds <= bound:
                self.compile_bucket_counts[i] += 1
                break


class GrammarCompileCache:
    """Compiles constraints for one tokenizer; each distinct key compiles once (futures shared)."""

    def __init__(self, tokenizer_info: Any, max_workers: int = 2, max_entries: int = 512) -> None:
        import xgrammar as xgr

        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._futures: dict[GrammarKey, Future] = {}
        self._lock = threading.Lock()
        self._max_entries = max_entries
        self.stats = CompileStats()

    def submit(self, key: GrammarKey, count_hit: bool = True) -> Future:
        """The future of ``key``'s compiled grammar (shared with every earlier request for it).
        ``count_hit``: False for a validation compile, so the request's own add counts once."""
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self.stats.cache_hits += count_hit
                return fut
            if len(self._futures) >= self._max_entries:  # drop the oldest finished entry
                old = next((k for k, f in self._futures.items() if f.done()), None)
                if old is not None:
                    del self._futures[old]
            fut = self._futures[key] = self._pool.submit(self._compile, key)
            return fut

    def compile(self, key: GrammarKey, timeout: Optional[float] = None) -> Any:
        """Compile (or fetch) synchronously; ValueError if the constraint is invalid."""
        return self.submit(key, count_hit=False).result(timeout)

    def _compile(self, key: GrammarKey) -> Any:
        kind, spec, compact = key
        t0 = time.perf_counter()
        c = self._compiler
        try:
            if kind == "json":
                grammar = c.compile_json_schema(spec, any_whitespace=not compact, strict_mode=True)
            elif kind == "json_object":  # a JSON object (any keys), as JSON mode answers; not an array or scalar
                grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=not compact, strict_mode=False)
            elif kind == "regex":
                grammar = c.compile_regex(spec)
            elif kind == "choice":
                grammar = c.compile_grammar(choice_grammar(json.loads(spec)))
            elif kind == "grammar":
                grammar = c.compile_grammar(spec)
            elif kind == "structural_tag":
                grammar = _compile_structural_tag(c, spec)
            else:  # pragma: no cover - GrammarKey.of only makes the kinds above
                raise ValueError(f"unknown structured output kind {kind!r}")
        except ValueError as exc:
            self.stats.failures += 1
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
            self.stats.failures += 1
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(exc)}") from None
        self.stats.observe_compile(time.perf_counter() - t0)
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
