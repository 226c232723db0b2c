"""The Triton attention kernels over an FP8 KV cache (kv_cache_dtype="fp8") on the CPU under Triton's interpreter:
prefill, decode (split and not) and cascade read e4m3 K/V, scale them by (k_scale, v_scale) and must match the torch
reference over the same cache.

Only the reading half runs here: Triton's interpreter converts float32 to e4m3 wrongly where rounding carries into
the exponent (1.97 becomes 1.0, not 2.0), so the writing kernels' e4m3 stores are checked on a GPU (tests/gpu) and
in their PTX (``cvt.rn.satfinite.e4m3x2.f32``, test_triton_compile_sm90.py)."""

from __future__ import annotations

import sys

import pytest

from tests.triton_interpreter import interpreter_too_old, run_interpreted

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(interpreter_too_old(triton), reason="needs Triton >= 3.7's interpreter")

CASES = {  # requests [(cached, query rows)], Hq, Hkv, head_dim, block_size, KernelConfig kwargs, cascade prefix
    "mixed": ([(0, 7), (5, 1), (9, 6), (16, 1)], 4, 2, 64, 4, dict(block_n=16), 0),
    "decode_split4": ([(60, 1), (3, 1), (17, 1), (99, 1)], 8, 2, 64, 16, dict(block_n=16, num_splits=4), 0),
    "cascade": ([(40, 1), (45, 1), (52, 1)], 8, 2, 64, 8, dict(block_n=16), 32),
}


def _worker() -> None:
    import dataclasses
    import json

    import torch

    from tallyserve.attention import torch_ref
    from tallyserve.attention.triton_attn import KernelConfig, paged_attention
    from tests.unit.test_attention_ref import make_case

    results = {}
    for name, (reqs, hq, hkv, d, bs, cfg, prefix) in CASES.items():
        q, k, v, cache, meta, _, _ = make_case(reqs, hq, hkv, d, bs, seed=5)
        scales = (0.5, 0.25)
        fp8 = torch.zeros(cache.shape, dtype=torch.float8_e4m3fn)
        torch_ref.write_kv_cache(k, v, fp8, meta.slot_mapping, scales)
        if prefix:  # every request's first blocks are row 0's: a shared prefix, attended once
            tables = meta.block_tables.clone()
            tables[:, : prefix // bs] = tables[0, : prefix // bs]
            torch_ref.write_kv_cache(k, v, fp8, meta.slot_mapping, scales)
            meta = dataclasses.replace(meta, block_tables=tables, common_prefix_len=prefix,
                                       prefix_kv_lens=torch.tensor([prefix], dtype=torch.int32))
        ref = torch_ref.paged_attention(q, fp8, meta, 0.125, scales)
        out = paged_attention(q, fp8, meta, 0.125, config=KernelConfig(**cfg), kv_scale=scales)
        unscaled = torch_ref.paged_attention(q, fp8, meta, 0.125)
        results[name] = {"err": (out.float() - ref.float()).abs().max().item(),
                         "scales_matter": (unscaled.float() - ref.float()).abs().max().item()}
    print("RESULT " + json.dumps(results))


@pytest.fixture(scope="module")
def results():
    return run_interpreted([__file__])


@pytest.mark.parametrize("case", CASES)
def test_triton_reads_an_fp8_cache_like_the_reference(results, case):
    assert results[case]["err"] < 1e-4
    assert results[case]["scales_matter"] > 1e-2


if __name__ == "__main__":
    sys.path.insert(0, ".")
    _worker()
