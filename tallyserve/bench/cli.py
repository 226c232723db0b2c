"""`tallyserve bench`: load-test any OpenAI-compatible server and report latency and throughput."""

from __future__ import annotations

import argparse
import json

from tallyserve.bench.workloads import add_workload_args, workload_from_args


def _token_lengths(ns: argparse.Namespace, workload) -> str:
    """Make the synthetic prompt lengths exact token counts where a tokenizer is at hand; returns
    the unit the lengths are in ("tokens" or "words")."""
    from tallyserve.bench.client import api_root
    from tallyserve.bench.token_lengths import KINDS, apply_token_lengths, local_tokenizer, server_tokenizer

    if workload.name not in KINDS:
        return "words"
    if ns.tokenizer:
        tokenize = local_tokenizer(ns.tokenizer)
    else:
        tokenize = server_tokenizer(api_root(ns.base_url), ns.model, ns.api_key)
    if tokenize is None:
        return "words"
    apply_token_lengths(workload, tokenize)
    return "tokens"


def _cmd_bench(ns: argparse.Namespace) -> int:
    from tallyserve.bench.report import build_result, plot, print_report, write_json
    from tallyserve.bench.runner import BenchOptions, run_bench

    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    workload = workload_from_args(ns)
    extra = json.loads(ns.extra_body) if ns.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    opts = BenchOptions(
        base_url=ns.base_url, model=ns.model, max_concurrency=ns.max_concurrency,
        request_timeout=ns.request_timeout, temperature=ns.temperature, ignore_eos=ns.ignore_eos,
        api_key=ns.api_key, extra_body=extra, disable_tqdm=ns.disable_tqdm,
    )
    lengths = _token_lengths(ns, workload)
    records, duration, model = run_bench(workload, opts)
    config = {
        "base_url": ns.base_url, "model": model, "max_concurrency": ns.max_concurrency,
        "temperature": ns.temperature, "ignore_eos": ns.ignore_eos, "workload": workload.options,
        "prompt_lengths": lengths,
    }
    result = build_result("tallyserve bench", config, records, duration)
    print_report(result, title=f"tallyserve bench: {workload.name} against {ns.base_url}")
    if ns.output:
        write_json(result, ns.output)
    if ns.plot:
        plot(result, records, ns.plot)
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (streaming)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM extension)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory for exact token lengths of random/shared-prefix prompts "
                   "(default: the server's POST /tokenize; without either, lengths are in words)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--output", default=None, help="write the full record as JSON here")
    p.add_argument("--plot", default=None, help="write latency distributions and throughput as a PNG here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_workload_args(p, with_seed=True)
    p.set_defaults(func=_cmd_bench)
