"""EngineArgs as command-line flags: every field a --kebab-case flag (the `tallyserve` subcommands share them)."""

from __future__ import annotations

import argparse
import dataclasses

from tallyserve.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs field as a --kebab-case flag (booleans as --flag / --no-flag)."""
    group = parser.add_argument_group("engine arguments")
    for f in dataclasses.fields(EngineArgs):
        flag, kind = "--" + f.name.replace("_", "-"), str(f.type)
        if kind in ("bool", "Optional[bool]"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, dest=f.name)
        else:
            conv = float if "float" in kind else int if "int" in kind else str
            group.add_argument(flag, type=conv, default=None, dest=f.name)
    group.add_argument("--kv-offload-gb", type=float, default=None, dest="kv_offload_gb",
                       help="host-memory KV tier size in GiB (sets kv_offload_bytes)")
    group.add_argument("-tp", type=int, default=None, dest="tensor_parallel_size",
                       help="short for --tensor-parallel-size")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    given = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(EngineArgs)
        if getattr(ns, f.name, None) is not None
    }
    if getattr(ns, "kv_offload_gb", None) is not None:
        given["kv_offload_bytes"] = int(ns.kv_offload_gb * (1 << 30))
    return EngineArgs(**given)
