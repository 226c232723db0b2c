"""`tallyserve bench` against a live tiny-model `tallyserve serve`, for every workload kind: the JSON
has every field, completed + errors == requests, and token totals equal the sum of the usages
(and the server's own /metrics counters)."""

from __future__ import annotations

import json

import pytest
import torch

from tallyserve.cli import main
from tests.server.live_server import LiveServer, free_port, metrics
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

TOP_FIELDS = (
    "tool", "num_requests", "completed", "errors", "error_kinds", "duration_s", "total_input_tokens",
    "total_output_tokens", "request_throughput", "input_throughput", "output_throughput", "total_token_throughput",
    "config", "timeline", "requests",
) + tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p90", "p99"))
REQUEST_FIELDS = ("request_id", "conversation_id", "turn", "start_s", "ttft_s", "tpot_s", "latency_s", "num_chunks",
                  "prompt_tokens", "completion_tokens", "finish_reason", "error_kind", "error")
SMALL = ["--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5",
         "--shared-prefix-groups", "2", "--shared-prefix-len", "40", "--shared-prefix-suffix-len", "6",
         "--multi-turn-turns", "3", "--multi-turn-user-len", "10", "--multi-turn-system-len", "12",
         "--think-time", "0.02"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make_tiny_model(tmp_path_factory.mktemp("bench-llama"), "llama", seed=0)
    make_tiny_tokenizer(path)
    srv = LiveServer(path, tmp_path_factory.mktemp("bench-logs"))
    try:
        yield srv
    finally:
        srv.stop()
        torch.set_num_threads(threads)


def _bench(tmp_path, base_url, *args):
    out = tmp_path / "result.json"
    rc = main(["bench", "--base-url", base_url, "--disable-tqdm", "--output", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def _check_record(result, n):
    for key in TOP_FIELDS:
        assert key in result, key
    assert result["num_requests"] == len(result["requests"]) == n
    assert result["completed"] + result["errors"] == n
    assert sum(result["error_kinds"].values()) == result["errors"]
    ok = [r for r in result["requests"] if r["error_kind"] is None]
    for r in result["requests"]:
        assert set(REQUEST_FIELDS) <= set(r)
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in ok)
    assert result["total_output_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert result["requests_without_usage"] == 0
    return ok


def _token_counters(base_url):
    m = metrics(base_url)
    return m["tallyserve_prompt_tokens_total"], m["tallyserve_generation_tokens_total"]


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn"])
def test_bench_synthetic(server, tmp_path, kind):
    before = _token_counters(server.base_url)
    result = _bench(tmp_path, server.base_url, "--workload", kind, "--num-requests", "9", "--request-rate", "30",
                    "--ignore-eos", "--plot", str(tmp_path / "p.png"), *SMALL)
    ok = _check_record(result, 9)
    assert result["errors"] == 0 and len(ok) == 9
    after = _token_counters(server.base_url)
    assert after[0] - before[0] == result["total_input_tokens"]
    assert after[1] - before[1] == result["total_output_tokens"]
    assert result["total_output_tokens"] == sum(r["num_chunks"] and r["completion_tokens"] for r in ok)
    assert all(r["completion_tokens"] >= 1 and r["ttft_s"] is not None for r in ok)
    assert result["mean_e2el_ms"] > 0 and result["output_throughput"] > 0
    assert (tmp_path / "p.png").stat().st_size > 10_000
    if kind == "multi-turn":
        by_conv = {}
        for r in ok:
            by_conv.setdefault(r["conversation_id"], []).append(r)
        for turns in by_conv.values():
            for a, b in zip(turns, turns[1:]):  # history (reply included) grows turn by turn
                assert b["prompt_tokens"] > a["prompt_tokens"] + 3


def test_bench_file_traces_and_error_kinds(server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"arrival_s": 0.0, "prompt": "Hello, world! How are you", "max_tokens": 4},
        {"arrival_s": 0.01, "prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 3},
        {"arrival_s": 0.02, "conversation_id": "c", "messages": [{"role": "user", "content": "The cat sat"}],
         "max_tokens": 4},
        {"conversation_id": "c", "messages": [{"role": "user", "content": "on the mat"}], "max_tokens": 4},
        {"arrival_s": 0.03, "prompt": "the " * 600, "max_tokens": 4},  # longer than max_model_len: a 400
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    result = _bench(tmp_path, server.base_url, "--workload", f"file:{trace}", "--ignore-eos", "--max-concurrency", "2")
    ok = _check_record(result, 5)
    assert result["errors"] == 1 and list(result["error_kinds"]) == ["http_400"]
    assert [r["completion_tokens"] for r in ok] == [4, 3, 4, 4]

    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"id": f"s{i}", "conversations": [
        {"from": "human", "value": "What is the capital of France?"}, {"from": "gpt", "value": "Paris is"},
        {"from": "human", "value": "And Germany?"}, {"from": "gpt", "value": "Berlin"}]} for i in range(3)]))
    result = _bench(tmp_path, server.base_url, "--workload", f"file:{sharegpt}", "--request-rate", "50",
                    "--ignore-eos")
    ok = _check_record(result, 6)
    assert result["errors"] == 0 and [r["completion_tokens"] for r in ok] == [2, 1] * 3


def test_bench_connection_errors_are_counted(tmp_path):
    result = _bench(tmp_path, f"http://127.0.0.1:{free_port()}", "--model", "m", "--workload", "multi-turn",
                    "--num-requests", "4", *SMALL)
    _check_record(result, 4)
    assert result["completed"] == 0
    assert result["error_kinds"] == {"connect_error": 2, "skipped_after_error": 2}  # 2 conversations of 3 + 1


@pytest.mark.parametrize("kind", ["random", "shared-prefix"])
@pytest.mark.parametrize("source", ["server", "local"])
def test_bench_prompt_lengths_are_tokens(server, tmp_path, kind, source):
    """--random-input-len N means N prompt tokens (the server's usage), through the server's /tokenize
    or a local tokenizer directory; shared-prefix requests of a group send identical prefix ids."""
    from tallyserve.bench.workloads import WorkloadOptions, build_workload

    args = ["--workload", kind, "--num-requests", "6", "--ignore-eos", "--random-output-len", "2",
            "--random-input-len", "37", "--random-range-ratio", "0.5", "--shared-prefix-groups", "2",
            "--shared-prefix-len", "21", "--shared-prefix-suffix-len", "5", "--seed", "3"]
    if source == "local":
        args += ["--tokenizer", make_tiny_tokenizer(str(tmp_path / "tok"))]  # the server's tokenizer, saved again
    result = _bench(tmp_path, server.base_url, *args)
    assert result["config"]["prompt_lengths"] == "tokens"
    opts = WorkloadOptions(workload=kind, num_requests=6, seed=3, random_input_len=37, random_output_len=2,
                           random_range_ratio=0.5, shared_prefix_groups=2, shared_prefix_len=21,
                           shared_prefix_suffix_len=5)
    words = {s.request_id: len(s.prompt.split()) for s in build_workload(opts).requests}
    got = {r["request_id"]: r["prompt_tokens"] for r in result["requests"]}
    assert got == words  # the words drawn are now exact token counts
    if kind == "random":
        assert len(set(got.values())) > 1  # the range ratio still varies them
    else:
        assert set(got.values()) == {26}


def test_shared_prefix_token_ids_share_the_prefix(tmp_path):
    from tallyserve.bench.token_lengths import apply_token_lengths, local_tokenizer
    from tallyserve.bench.workloads import WorkloadOptions, build_workload

    make_tiny_tokenizer(tmp_path)
    wl = build_workload(WorkloadOptions(workload="shared-prefix", num_requests=12, shared_prefix_groups=3,
                                        shared_prefix_len=30, shared_prefix_suffix_len=4, random_output_len=1))
    groups = [s.prompt.split(" ")[:30] for s in wl.requests]
    assert apply_token_lengths(wl, local_tokenizer(str(tmp_path))) == 12
    heads: dict[str, list[int]] = {}
    for words, spec in zip(groups, wl.requests):
        assert spec.prompt is None and len(spec.prompt_token_ids) == 34
        assert heads.setdefault(" ".join(words), spec.prompt_token_ids[:30]) == spec.prompt_token_ids[:30]
    assert len(heads) == 3 and len({tuple(v) for v in heads.values()}) == 3


def test_bench_times_a_server_without_tokenizer(tmp_path):
    """A dummy-weight style server with no tokenizer: token-id prompts from a trace, empty-text chunks
    still mark each token's arrival, so TTFT is measured for every request (a fast engine may
    coalesce a short answer into one chunk)."""
    path = make_tiny_model(tmp_path / "m", "llama", seed=1)  # no tokenizer files
    (tmp_path / "logs").mkdir()
    srv = LiveServer(path, tmp_path / "logs")
    try:
        trace = tmp_path / "trace.jsonl"
        trace.write_text("".join(json.dumps({"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 5}) + "\n"
                                 for n in (4, 9, 17)))
        result = _bench(tmp_path, srv.base_url, "--workload", f"file:{trace}", "--ignore-eos")
    finally:
        srv.stop()
    assert result["completed"] == 3 and result["errors"] == 0
    assert [r["prompt_tokens"] for r in result["requests"]] == [4, 9, 17]
    for r in result["requests"]:
        assert r["completion_tokens"] == 5 and r["ttft_s"] is not None and r["num_chunks"] >= 1
    assert result["p50_ttft_ms"] is not None
