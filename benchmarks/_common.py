"""What the benchmark tools share: the import path, subcommand dispatch, logging, ports and health waits.

Every tool (``cpu.py``, ``gpu.py``, ``serving.py``, ``kernels.py``, ``features.py``) imports this first, so the
repository root (the ``tallyserve`` package, ``benchmarks.*``) and this folder (the helper modules) are importable
however the tool is started (``python benchmarks/cpu.py ...`` from the repo root or elsewhere).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional, Sequence

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (str(BENCH), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# name -> (one-line help, fn(argv, prog) -> exit status)
Command = tuple[str, Callable[[list[str], str], int]]


def run_tool(doc: str, commands: dict[str, Command], argv: Optional[Sequence[str]] = None) -> int:
    """``TOOL COMMAND [options]``: each command parses its own options (``TOOL COMMAND --help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tool = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "tool"
    top = argparse.ArgumentParser(prog=tool, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in commands:
        top.parse_args(argv[:1])  # --help, or an error naming the commands
        top.print_help()
        return 2
    return commands[argv[0]][1](argv[1:], f"{tool} {argv[0]}")


def parser(prog: str, doc: Optional[str]) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``url/health`` answers 200; RuntimeError if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in time")


def engine_kwargs(pairs: Sequence[str]) -> dict:
    """``--engine-arg key=value`` pairs as LLM keyword arguments (bool, int, float, else str)."""
    kwargs: dict = {}
    for kv in pairs:
        key, val = kv.split("=", 1)
        if val.lower() in ("true", "false"):
            kwargs[key] = val.lower() == "true"
            continue
        for conv in (int, float):
            try:
                val = conv(val)
                break
            except ValueError:
                pass
        kwargs[key] = val
    return kwargs
