"""The fused MoE kernels (kernels/fused_moe.py) on the CPU under Triton's interpreter, in float32, against the
per-expert loop of ``FusedMoE`` (itself checked against transformers in tests/model/test_moe.py): routers that spread
tokens, send every token to one expert, leave experts empty, and expert parallelism's half of the experts; plus the
tile layout ``align`` builds (every pair once, padded per expert, tiles past the end marked)."""

from __future__ import annotations

import sys

import pytest

from tests.triton_interpreter import interpreter_too_old, run_interpreted

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(interpreter_too_old(triton), reason="needs Triton >= 3.7's interpreter")

CASES = {  # tokens, experts, top_k, router ("random" | "one" | "few"), expert-parallel rank of 2 (None: all)
    "spread": (37, 8, 2, "random", None),
    "one_expert": (21, 8, 2, "one", None),
    "few_experts_decode": (3, 16, 4, "few", None),
    "expert_parallel_rank1": (29, 8, 2, "random", 1),
}


def _worker() -> None:
    import json

    import torch

    from tallyserve.kernels import fused_moe
    from tallyserve.models.moe import FusedMoE

    results = {}
    for name, (tokens, experts, top_k, router, ep_rank) in CASES.items():
        torch.manual_seed(3)
        h, inter = 48, 40
        ref = FusedMoE(h, inter, experts, top_k, True)
        with torch.no_grad():
            for p in (ref.w1, ref.w3, ref.w2, ref.gate.weight):
                p.normal_(0, 0.2)
            if router == "one":
                ref.gate.weight.zero_()
                ref.gate.weight[5] = 1.0
            if router == "few":
                ref.gate.weight[4:] = -50.0  # experts 4.. never win
        x = torch.randn(tokens, h)
        weights, ids = ref.route(x)
        want = ref.forward(x)  # the per-expert loop (w13 not set)
        if ep_rank is None:
            ref.fuse()
            got = fused_moe.fused_moe(x, ref.w13, ref.w2, weights, ids)
        else:  # rank 1 of 2 holds experts 4..7: its partial sum, against the loop over those experts only
            half = experts // 2
            lo = ep_rank * half
            w13 = torch.cat([ref.w1, ref.w3], dim=1)[lo:lo + half].contiguous()
            got = fused_moe.fused_moe(x, w13, ref.w2[lo:lo + half].contiguous(), weights, ids, lo, experts)
            mask = ((ids >= lo) & (ids < lo + half)).float()
            part = FusedMoE(h, inter, experts, top_k, True)
            with torch.no_grad():
                part.load_state_dict(ref.state_dict())
            want = torch.zeros_like(x)
            for k in range(top_k):  # the local pairs' contributions, one top-k slot at a time
                for t in range(tokens):
                    if mask[t, k]:
                        e = int(ids[t, k])
                        g = x[t] @ ref.w1[e].t()
                        u = x[t] @ ref.w3[e].t()
                        want[t] += (torch.nn.functional.silu(g) * u) @ ref.w2[e].t() * weights[t, k]
        sorted_pairs, tile_expert = fused_moe.align(ids, experts, 16)
        pairs = sorted_pairs[sorted_pairs < tokens * top_k]
        results[name] = {
            "err": (got - want).abs().max().item(),
            "scale": want.abs().max().item(),
            "pairs_once": sorted(pairs.tolist()) == list(range(tokens * top_k)),
            "tiles_one_expert": all(
                len({int(ids.reshape(-1)[p]) for p in sorted_pairs[i * 16:(i + 1) * 16].tolist() if p < tokens * top_k})
                <= 1 for i in range(tile_expert.numel())),
            "tiles_marked": int((tile_expert == experts).sum()) + int((tile_expert < experts).sum())
            == tile_expert.numel(),
        }
    print("RESULT " + json.dumps(results))


@pytest.fixture(scope="module")
def results():
    return run_interpreted([__file__])


@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_the_per_expert_loop(results, case):
    r = results[case]
    assert r["err"] < 1e-4 * max(1.0, r["scale"]), r
    assert r["pairs_once"] and r["tiles_one_expert"] and r["tiles_marked"]


if __name__ == "__main__":
    sys.path.insert(0, ".")
    _worker()
