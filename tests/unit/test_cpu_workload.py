"""Workload W of the CPU side-by-side (benchmarks/cpu_workload.py): its prompts and the result aggregation."""

import random

import pytest

from benchmarks.cpu_workload import (agreement, common_prefix_fraction, describe, identical_fraction,
                                     make_workload, summarize, total_tokens)


def test_w_has_the_documented_shape_and_total():
    w = make_workload()
    assert len(w) == 64
    assert total_tokens(w) == 16103  # the figure docs/benchmarks.md and the script print
    assert all(32 <= len(p) <= 512 for p in w)
    assert all(100 <= t < 40000 for p in w for t in p)
    d = describe(w)
    assert d["prompt_tokens"] == 16103 and d["output_tokens"] == 64 * 64


def test_w_is_deterministic_and_quick_runs_are_its_prefix():
    assert make_workload() == make_workload()
    assert make_workload(5) == make_workload()[:5]
    assert make_workload(seed=1) != make_workload()


def test_w_starts_with_the_cpu_slice_prompts():
    # benchmarks/cpu_w_slice.py draws its 16 prompts this way: W's first 16 must be exactly those
    rng = random.Random(0)
    slice_prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(32, 513))] for _ in range(16)]
    assert make_workload(16) == slice_prompts
    assert total_tokens(slice_prompts) == 4106


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_prompt_count_is_a_value_error(bad):
    with pytest.raises(ValueError, match="num_prompts"):
        make_workload(bad)


def test_output_agreement_fractions():
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    b = [[1, 2, 3, 4], [5, 6, 0, 0], [9, 9]]
    assert identical_fraction(a, b) == pytest.approx(2 / 3)
    assert common_prefix_fraction(a, b) == pytest.approx((1 + 0.5 + 1) / 3)
    assert common_prefix_fraction([[1, 2]], [[1, 2, 3, 4]]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="length"):
        identical_fraction(a, b[:2])


def test_agreement_covers_every_pair_of_engines_with_outputs():
    outs = {"x": [[1, 2]], "y": [[1, 3]], "z": [[1, 2]], "failed": None}
    pairs = agreement(outs)
    assert set(pairs) == {"x vs y", "x vs z", "y vs z"}
    assert pairs["x vs z"]["identical"] == 1.0 and pairs["x vs y"]["identical"] == 0.0
    assert pairs["x vs y"]["common_prefix"] == 0.5


def test_summary_takes_the_min_over_rounds_and_ratios_to_the_baseline():
    rounds = [{"tallyserve": 10.0, "vllm": 6.0, "llama.cpp": None},
              {"tallyserve": 8.0, "vllm": 7.0, "llama.cpp": 12.0},
              {"tallyserve": 9.0, "vllm": 4.0, "llama.cpp": None}]
    s = summarize(rounds)
    assert s["tallyserve"]["min_s"] == 8.0 and s["tallyserve"]["vs_tallyserve"] == 1.0
    assert s["vllm"]["min_s"] == 4.0 and s["vllm"]["vs_tallyserve"] == 0.5
    assert s["llama.cpp"]["min_s"] == 12.0 and s["llama.cpp"]["rounds_ok"] == 1
    assert s["llama.cpp"]["vs_tallyserve"] == 1.5
    assert s["llama.cpp"]["times_s"] == [None, 12.0, None]


def test_summary_without_a_baseline_or_a_successful_round_has_no_ratio():
    s = summarize([{"tallyserve": None, "vllm": 3.0}])
    assert s["tallyserve"]["min_s"] is None and s["tallyserve"]["rounds_ok"] == 0
    assert s["vllm"]["vs_tallyserve"] is None
    s = summarize([{"tallyserve@1t": 2.0, "vllm@1t": 3.0}], baseline="tallyserve@1t")
    assert s["vllm@1t"]["vs_tallyserve@1t"] == 1.5


def test_serving_summary_per_stream_token_time_and_ttft():
    from benchmarks.cpu_serving import summarize_streams
    from tallyserve.bench.metrics import RequestRecord

    recs = [RequestRecord(request_id="a", ttft_s=0.5, latency_s=0.5 + 63 * 0.02, completion_tokens=64),
            RequestRecord(request_id="b", ttft_s=1.5, latency_s=1.5 + 63 * 0.04, completion_tokens=64),
            # no usage chunk (a server that does not send one): tokens counted from the streamed chunks
            RequestRecord(request_id="c", ttft_s=1.0, latency_s=1.0 + 3 * 0.03, chunk_times_s=[1.0, 1.03, 1.06, 1.09]),
            RequestRecord(request_id="d", error_kind="http_400", error="bad")]
    s = summarize_streams(10.0, recs, num_streams=16)
    assert s["requests"] == 4 and s["ok"] == 3 and s["streams"] == 16
    assert s["output_tokens"] == 64 + 64 + 4
    assert s["output_tok_per_s"] == pytest.approx(13.2)
    assert s["mean_ttft_ms"] == pytest.approx(1000.0) and s["median_ttft_ms"] == pytest.approx(1000.0)
    assert s["mean_tpot_ms"] == pytest.approx(30.0) and s["median_tpot_ms"] == pytest.approx(30.0)
    assert s["errors"] == ["d: http_400: bad"]


def test_bench_cli_lists():
    import argparse

    from benchmarks.cpu_bench import ENGINES, engine_key, parse_list

    assert parse_list("vllm, llama.cpp", ENGINES) == ["vllm", "llama.cpp"]
    assert parse_list("2,1", kind=int) == [2, 1]
    with pytest.raises(argparse.ArgumentTypeError, match="sglang"):
        parse_list("tallyserve,sglang", ENGINES)
    assert engine_key("tallyserve", 1) == "tallyserve@1t"


def test_serving_summary_over_rounds_takes_each_metric_best_and_skips_failed_runs():
    from benchmarks.cpu_workload import summarize_serving

    def run(streams, ttft, tpot, tps, ok=8):
        return {"streams": streams, "requests": 8, "ok": ok, "mean_ttft_ms": ttft, "mean_tpot_ms": tpot,
                "output_tok_per_s": tps}

    rounds = [{"tallyserve@2t": {"runs": [run(1, 100.0, 20.0, 40.0), run(16, 900.0, 60.0, 200.0)]},
               "llama.cpp@2t": {"error": "did not start"}},
              {"tallyserve@2t": {"runs": [run(1, 120.0, 18.0, 45.0), run(16, 1.0, 1.0, 999.0, ok=7)]},
               "llama.cpp@2t": {"runs": [run(1, 50.0, 10.0, 90.0)]}}]
    s = summarize_serving(rounds)
    assert s["tallyserve@2t"]["streams=1"] == {"mean_ttft_ms": 100.0, "mean_tpot_ms": 18.0,
                                               "output_tok_per_s": 45.0, "rounds_ok": 2}
    # the 16-stream run of round 1 lost a request: it does not count
    assert s["tallyserve@2t"]["streams=16"] == {"mean_ttft_ms": 900.0, "mean_tpot_ms": 60.0,
                                                "output_tok_per_s": 200.0, "rounds_ok": 1}
    assert s["llama.cpp@2t"]["streams=1"]["rounds_ok"] == 1


def test_bf16_gguf_for_llama_cpp_keeps_shapes_and_rounds_matrices(tmp_path):
    """The llama.cpp-bf16 engine's GGUF: every matrix BF16 with the source's shape, norms F32, values the
    source's rounded to bfloat16 (a wrong byte shape once made llama-server refuse the file)."""
    import gguf
    import numpy as np
    import torch

    from benchmarks import cpu_setup
    from tallyserve.models.bundled import bundled_gguf_path

    paths = cpu_setup.Paths(tmp_path)
    cpu_setup.write_bf16_gguf(paths)
    src = {t.name: t for t in gguf.GGUFReader(bundled_gguf_path()).tensors}
    out = {t.name: t for t in gguf.GGUFReader(paths.bf16_gguf).tensors}
    assert set(out) == set(src)
    for name, t in out.items():
        assert t.shape.tolist() == src[name].shape.tolist(), name
        want = gguf.GGMLQuantizationType.BF16 if len(t.shape) == 2 else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want, name
    name = "blk.0.ffn_down.weight"
    got = gguf.quants.dequantize(out[name].data, out[name].tensor_type)
    ref = gguf.quants.dequantize(src[name].data, src[name].tensor_type).astype(np.float32)
    rounded = torch.from_numpy(ref.reshape(-1)).to(torch.bfloat16).float().numpy()
    assert np.array_equal(got.reshape(-1), rounded)
