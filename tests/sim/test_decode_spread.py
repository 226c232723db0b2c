"""Pure decode steps in the profile cost model: the CUDA graph's padding rows and uneven lengths
(`tallyserve profile`'s `cuda_graph_batch_sizes` and `decode_spread`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.profile import rows_output, spread_lengths
from tallyserve.sim.cost_model import StepShape
from tallyserve.sim.profile_cost import ProfileCostModel

# decode-only grid: batch 1 / 16 / 64, contexts 0 / 512 / 1280; host 1 ms, stream = total - 1 ms
_STEP = [[[0.004, 0.0041, 0.0042]], [[0.005, 0.0056, 0.0064]], [[0.0061, 0.0071, 0.0086]]]


def _profile(**extra) -> dict:
    return {"batch_size": [1, 16, 64], "extra_tokens": [0], "context_len": [0, 512, 1280], "step_time_s": _STEP,
            "host_time_s": [[[0.001] * 3]] * 3, "stream_time_s": [[[t - 0.001 for t in r[0]]] for r in _STEP],
            **extra}


def _spread(step_extra=0.002, stream_extra=0.0018) -> dict:
    # batch 16 and 64 at 512 and 1280 measured with lengths +-384 (max - mean 360): 2 ms (1.8 ms streamed) more
    grid = {16: 1, 64: 2}
    return {"half_width": 384, "batch_size": [16, 64], "context_len": [512, 1280],
            "max_minus_mean": [[360.0, 360.0], [360.0, 360.0]],
            "step_time_s": [[_STEP[grid[b]][0][k] + step_extra for k in (1, 2)] for b in (16, 64)],
            "host_time_s": [[0.001, 0.001]] * 2,
            "stream_time_s": [[_STEP[grid[b]][0][k] - 0.001 + stream_extra for k in (1, 2)] for b in (16, 64)]}


def _decode(lens) -> StepShape:
    return StepShape.of(rows_output([(1, c) for c in lens], 16, 100_000))


def test_step_shape_knows_its_longest_request():
    s = _decode([100, 300, 500])
    assert s.max_seq_len == 501 and s.context_tokens == 903
    assert s.seq_len_spread == pytest.approx(501 - 301)
    assert StepShape(3, 3, 3, 3, 903, 903).seq_len_spread == 0.0  # unknown: no spread


def test_spread_lengths_keep_the_mean_and_shuffle():
    lens = spread_lengths(256, 512, 384)
    assert len(lens) == 256 and sum(lens) / 256 == pytest.approx(512, abs=0.5)
    assert min(lens) >= 128 and max(lens) <= 896 and max(lens) - 512 > 380
    assert lens != sorted(lens) and lens != sorted(lens, reverse=True)
    assert spread_lengths(8, 100, 384) == spread_lengths(8, 100, 384)  # fixed order
    assert min(spread_lengths(8, 100, 384)) >= 0  # the half width stops at the context


def test_graph_padding_rows_cost_the_bucket():
    """12 requests replay the 16-request graph: the grid's step at (16, 0) less (12, 0) on top."""
    cost = ProfileCostModel(_profile(cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64]))
    plain = ProfileCostModel(_profile())
    step = _decode([512] * 12)
    pad = 0.005 - (0.004 + 11 / 15 * 0.001)
    assert cost.step_time(step, overlapped=False) == pytest.approx(plain.step_time(step, overlapped=False) + pad)
    for overlapped in (True, False):  # a captured size, and a step past the largest graph: as before
        for lens in ([512] * 16, [512] * 70):
            assert cost.step_time(_decode(lens), overlapped) == pytest.approx(plain.step_time(_decode(lens), overlapped))
    mixed = StepShape(12 + 100, 12, 11, 12, 12 * 512 + 100, 11 * 513 + 101 * 100 // 2)  # eager: no graph
    assert cost.step_time(mixed, False) == pytest.approx(plain.step_time(mixed, False))


def test_uneven_decode_lengths_cost_what_the_profile_measured():
    cost = ProfileCostModel(_profile(decode_spread=_spread()))
    plain = ProfileCostModel(_profile())
    even = _decode([800] * 64)
    assert cost.step_time(even, False) == pytest.approx(plain.step_time(even, False))
    uneven = _decode([800 - 180, 800 + 180] * 32)  # mean 801, longest 981: 180 past the mean
    assert uneven.seq_len_spread == pytest.approx(180)
    assert cost.step_time(uneven, False) - plain.step_time(uneven, False) == pytest.approx(0.001)  # 2 ms x 180 / 360
    assert cost.step_time(uneven, True) - plain.step_time(uneven, True) == pytest.approx(0.0009)  # streamed: 1.8 ms
    # held at the edges: 8 requests use batch 16's rate, 2000 tokens 1280's
    small = _decode([800 - 180, 800 + 180] * 4)
    assert cost.step_time(small, False) - plain.step_time(small, False) == pytest.approx(0.001)
    long = _decode([2000 - 180, 2000 + 180] * 32)
    assert cost.step_time(long, False) - plain.step_time(long, False) == pytest.approx(0.001)
    mixed = StepShape(64 + 100, 64, 63, 64, 63 * 801 + 180 + 100, 63 * 801 + 5050)
    assert cost.step_time(mixed, False) == pytest.approx(plain.step_time(mixed, False))  # only pure decode steps


def test_decode_spread_rate_follows_the_measurement_per_point():
    sp = _spread()
    sp["step_time_s"][1][1] += 0.0036  # batch 64 at 1280: 5.6 ms more, not 2
    cost = ProfileCostModel(_profile(decode_spread=sp))
    plain = ProfileCostModel(_profile())
    step = _decode([1280 - 180, 1280 + 180] * 20)  # batch 40: halfway between 16 and 64
    assert step.cached_len == pytest.approx(1280)
    assert cost.step_time(step, False) - plain.step_time(step, False) == pytest.approx(180 * (2 + 5.6) / 2 / 360 * 1e-3)


def test_bad_decode_spread_is_refused():
    for bad in ({**_spread(), "max_minus_mean": [[0.0, 1.0], [1.0, 1.0]]}, {**_spread(), "step_time_s": [[0.1]]},
                {**_spread(), "batch_size": [64, 16]}):
        with pytest.raises(ValueError, match="decode_spread"):
            ProfileCostModel(_profile(decode_spread=bad))
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        ProfileCostModel(_profile(cuda_graph_batch_sizes=[0, 16]))


def test_profile_measures_uneven_decode_steps(tiny_dir, tmp_path):
    from tallyserve.cli import main

    prof = tmp_path / "profile.json"
    rc = main(["profile", "--model", tiny_dir, "--batch-sizes", "1,3", "--extra-tokens", "0",
               "--context-lens", "0,12,24", "--repeats", "1", "--num-gpu-blocks-override", "64", "--block-size", "4",
               "--decode-spread", "8", "--output", str(prof), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(prof.read_text())
    assert data["cuda_graph_batch_sizes"] == []  # the CPU runs eagerly
    sp = data["decode_spread"]
    assert sp["half_width"] == 8 and sp["batch_size"] == [3] and sp["context_len"] == [12, 24]
    lens = spread_lengths(3, 12, 8)
    assert sp["max_minus_mean"][0][0] == pytest.approx(max(lens) - sum(lens) / 3)
    for key in ("step_time_s", "host_time_s", "stream_time_s"):
        assert len(sp[key]) == 1 and len(sp[key][0]) == 2 and all(t > 0 for t in sp[key][0])
    ProfileCostModel(data)  # loads


def test_sim_fidelity_reprices_old_records_with_their_longest_request():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import sim_fidelity

    so: SchedulerOutput = rows_output([(1, 800 - 180), (1, 800 + 180)] * 8, 16, 100_000)
    shape = StepShape.of(so).__dict__.copy()
    del shape["max_seq_len"]  # recorded before the field existed
    steps = [{"shape": shape, "overlapped": False, "rows": [(e.request_id, e.num_tokens, e.start_position)
                                                            for e in so.requests]}]
    sim_fidelity.predict_steps(steps, ProfileCostModel(_profile(decode_spread=_spread())))
    plain = ProfileCostModel(_profile()).step_time(StepShape.of(so), False)
    assert steps[0]["predicted_ms"] == pytest.approx((plain + 0.001) * 1e3, abs=1e-3)
