"""A grammar-compile worker process: ``python -m tallyserve.structured_output.compile_worker``.

xgrammar compiles in C++ and cannot be interrupted, and some constraints take minutes (a 30k-value
enum, an object of thousands of properties). So compiles run here, in a process of their own that
the engine kills when a compile passes its deadline or nobody waits for it any more
(`compile_pool.CompilePool`). The worker holds no state worth keeping: a killed one is replaced.

The protocol on stdin / stdout: frames of an 8-byte little-endian length and a pickled tuple.
  parent -> worker: ("info", key, tokenizer_info_json)      describe a tokenizer under `key`
                    ("compile", job, key, kind, spec, compact)
  worker -> parent: ("ready",) once, when xgrammar is imported; then for each compile
                    ("ok", job, compiled_grammar_json) | ("err", job, error_type, message)
The worker's data segment is capped (RLIMIT_DATA: what it uses at start plus
``TALLYSERVE_COMPILE_WORKER_MEMORY`` bytes, default 1 GiB), so a compile that would eat the
machine's memory fails as an error instead; it dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import pickle
import struct
import sys
from typing import Any, BinaryIO, Optional

from tallyserve import envs

_HEADER = struct.Struct("<Q")
DEFAULT_WORKER_MEMORY = 1 << 30


def write_frame(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def read_frame(f: BinaryIO) -> Optional[Any]:
    """The next frame, or None at end of file (the other side is gone)."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    data = f.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


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


def compile_grammar(compiler: Any, kind: str, spec: str, compact: bool) -> Any:
    """Compile one constraint with an xgrammar GrammarCompiler."""
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=not compact, strict_mode=True)
    if kind == "json_object":  # a JSON object (any keys), as JSON mode answers; not an array or scalar
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec)))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the parent's atexit kill and stdin's EOF remain
        pass


def _cap_memory() -> None:
    try:
        import resource

        extra = int(envs.TALLYSERVE_COMPILE_WORKER_MEMORY or DEFAULT_WORKER_MEMORY)
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + extra, resource.RLIM_INFINITY))
    except Exception:  # noqa: BLE001 - no /proc or no RLIMIT_DATA: the deadline still bounds a compile
        pass


def main() -> int:
    _die_with_parent()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames goes to the parent's pipe
    import xgrammar as xgr

    _cap_memory()
    write_frame(out, ("ready",))
    compilers: dict[str, Any] = {}
    while True:
        msg = read_frame(inp)
        if msg is None:
            return 0
        if msg[0] == "info":
            _, key, text = msg
            if len(compilers) >= 8:  # a few tokenizers per process at most (tests build many engines)
                compilers.pop(next(iter(compilers)))
            info = xgr.TokenizerInfo.deserialize_json(text)
            compilers[key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            continue
        _, job, key, kind, spec, compact = msg
        try:
            grammar = compile_grammar(compilers[key], kind, spec, compact)
            reply = ("ok", job, grammar.serialize_json())
        except MemoryError:
            reply = ("err", job, "MemoryError", "the compile ran out of its memory limit")
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError / ValueError
            reply = ("err", job, type(exc).__name__, str(exc))
        write_frame(out, reply)


if __name__ == "__main__":
    sys.exit(main())
