"""The `tallyserve` command line: generate, serve, and more by subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable, Optional, Sequence

from tallyserve.config.args import add_engine_args, engine_args_from

def _cmd_generate(ns: argparse.Namespace) -> int:
    from tallyserve.engine.llm import LLM
    from tallyserve.sampling_params import SamplingParams

    args = engine_args_from(ns)
    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        seed=ns.sampling_seed, n=ns.n, stop=ns.stop or None, ignore_eos=ns.ignore_eos,
    )
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params)
    else:
        outs = llm.generate(list(ns.prompts), params)
    for out in outs:
        for comp in out.outputs:
            if ns.json:
                print(json.dumps({"prompt": out.prompt, "index": comp.index, "text": comp.text,
                                  "token_ids": comp.token_ids, "finish_reason": comp.finish_reason}))
            else:
                print(f"{out.prompt!r} -> {comp.text!r} [{comp.finish_reason}]")
    if ns.stats:
        print(json.dumps(llm.stats(), indent=2), file=sys.stderr)
    return 0


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--json", action="store_true", help="one JSON object per completion")
    p.add_argument("--stats", action="store_true", help="print engine stats to stderr")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)


# Other modules register subcommands here: name -> (builder(subparsers)).
SUBCOMMANDS: list[Callable[[Any], None]] = [_generate_parser]


_OPTIONAL = {"tallyserve.server.cli": ("serve",), "tallyserve.server.proxy": ("proxy",), "tallyserve.bench.cli": ("bench",),
             "tallyserve.sim.cli": ("simulate",), "tallyserve.profile": ("profile",)}
_UNAVAILABLE: set[str] = set()


def _unavailable(names: tuple[str, ...], exc: ImportError) -> Callable[[Any], None]:
    """A subcommand whose module cannot be imported still parses, and says why it cannot run."""
    def fail(ns: argparse.Namespace) -> int:
        print(f"tallyserve: error: `tallyserve {ns.command}` needs a package that is not installed: {exc} "
              f"(install tallyserve with its dependencies: pip install -e .)", file=sys.stderr)
        return 2

    def register(sub) -> None:
        for name in names:
            p = sub.add_parser(name, help=f"(unavailable: {exc})", add_help=False, prefix_chars="\0")
            p.add_argument("args", nargs="*")  # whatever follows: no option is parsed
            p.set_defaults(func=fail)
    return register


def _load_optional_subcommands() -> None:
    for mod, names in _OPTIONAL.items():
        try:
            __import__(mod)
        except ImportError as exc:
            if mod not in _UNAVAILABLE:
                _UNAVAILABLE.add(mod)
                SUBCOMMANDS.append(_unavailable(names, exc))
            continue
        builder = getattr(sys.modules[mod], "register", None)
        if builder is not None and builder not in SUBCOMMANDS:
            SUBCOMMANDS.append(builder)


def build_parser() -> argparse.ArgumentParser:
    _load_optional_subcommands()
    parser = argparse.ArgumentParser(prog="tallyserve", description="tallyserve: an LLM engine with an exact token tally")
    sub = parser.add_subparsers(dest="command", required=True)
    for builder in SUBCOMMANDS:
        builder(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as exc:
        print(f"tallyserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
