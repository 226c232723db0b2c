"""tallyserve's CPU task pool (task_pool_cpu.cpp), which the thread governor turns on while it shares the cores with
other processes: every kernel that spreads work over it (the AVX2 product, paged attention, the fused operators,
the greedy argmax) gives bit-identical results on the pool and on ATen's threads, a second Python thread calling
in while the pool is busy still gets its own correct result, a task's error reaches the caller and leaves the
pool usable, and a whole greedy generation is token-for-token the same."""
from __future__ import annotations

import threading

import pytest
import torch

from tallyserve.kernels import cpu_kernels
from tests.kernel_errors import RAW_THROW
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")


@pytest.fixture
def pool():
    ops = torch.ops.tallyserve_cpu
    prev = torch.get_num_threads()
    yield ops
    ops.set_task_pool_threads(0)
    torch.set_num_threads(prev)


def on_pool(ops, n, fn):
    """fn() with ATen on one thread and the pool on n (as the governor shares the cores)."""
    torch.set_num_threads(1)
    ops.set_task_pool_threads(n)
    try:
        assert ops.task_pool_threads() == (n if n > 1 else 0)
        return fn()
    finally:
        ops.set_task_pool_threads(0)


def test_threads_are_set_and_bad_counts_refused(pool):
    assert pool.task_pool_threads() == 0  # off unless the governor turns it on
    pool.set_task_pool_threads(5)
    assert pool.task_pool_threads() == 5
    pool.set_task_pool_threads(1)  # one thread is no pool
    assert pool.task_pool_threads() == 0
    cpu_kernels.set_task_pool_threads(3)  # the checked setter the thread governor calls
    assert pool.task_pool_threads() == 3
    for bad in (-1, 100000, 2.5, "4", None):  # refused in Python, before the kernel's own check
        with pytest.raises(ValueError, match="0 \\(off\\) to"):
            cpu_kernels.set_task_pool_threads(bad)
    assert pool.task_pool_threads() == 3
    cpu_kernels.set_task_pool_threads(0)
    assert pool.task_pool_threads() == 0


@RAW_THROW
def test_the_kernel_refuses_bad_counts_itself(pool):
    for bad in (-1, 100000):
        with pytest.raises(RuntimeError, match="0 \\(off\\) to"):
            pool.set_task_pool_threads(bad)
    assert pool.task_pool_threads() == 0


@pytest.mark.skipif(not (cpu_kernels.load() and torch.ops.tallyserve_cpu.sgemm_built()),
                    reason="the kernels were built without AVX2 + FMA")
@pytest.mark.parametrize("m", [1, 64, 700])
def test_products_are_bit_identical_on_the_pool(pool, m):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=g), torch.randn(200, 96, generator=g)
    packed = pool.pack_sgemm_weight(w)
    ref = pool.linear_sgemm(x, packed, 200)
    for n in (2, 3, 8):
        assert torch.equal(on_pool(pool, n, lambda: pool.linear_sgemm(x, packed, 200)), ref)


def paged_case(seed):
    """Three requests (decode rows and a prompt chunk) over a shuffled float32 paged cache."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, hq, d, nb = 16, 3, 9, 64, 40
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    seq_lens = torch.tensor([37, 120, 70])
    rows = torch.tensor([1, 1, 30])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), rows.cumsum(0)])
    tables = torch.randperm(nb, generator=g)[:3 * 8].view(3, 8).to(torch.int32)
    q = torch.randn(int(rows.sum()), hq, d, generator=g)
    return q, cache, tables, qsl, seq_lens


def test_attention_is_bit_identical_on_the_pool(pool):
    q, cache, tables, qsl, seq_lens = paged_case(1)
    ref = pool.paged_attention(q, cache, tables, qsl, seq_lens, 0.125)
    got = on_pool(pool, 6, lambda: pool.paged_attention(q, cache, tables, qsl, seq_lens, 0.125))
    assert torch.equal(got, ref)


def test_fused_operators_and_argmax_are_bit_identical_on_the_pool(pool):
    g = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(300, 576, generator=g), torch.randn(300, 576, generator=g), torch.randn(576, generator=g)
    ref = pool.add_rms_norm(x, r.clone(), w, 1e-5)
    got = on_pool(pool, 4, lambda: pool.add_rms_norm(x, r.clone(), w, 1e-5))
    assert torch.equal(got, ref)
    logits = torch.randn(37, 5000, generator=g)
    logits[5, 17] = logits[5].max() + 1
    ids = on_pool(pool, 4, lambda: pool.argmax_rows(logits))
    assert torch.equal(ids, logits.argmax(dim=-1))


@pytest.mark.skipif(not (cpu_kernels.load() and torch.ops.tallyserve_cpu.sgemm_built()),
                    reason="the kernels were built without AVX2 + FMA")
def test_a_second_thread_calling_in_gets_its_own_result(pool):
    """One call at a time runs on the pool; another thread's call meanwhile runs on ATen's threads, correctly."""
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(512, 256, generator=g) for _ in range(2)]
    xs = [torch.randn(300, 256, generator=g) for _ in range(2)]
    packed = [pool.pack_sgemm_weight(w) for w in ws]
    refs = [pool.linear_sgemm(x, p, 512) for x, p in zip(xs, packed)]
    torch.set_num_threads(1)
    pool.set_task_pool_threads(4)
    bad: list[int] = []

    def hammer(i):
        for _ in range(30):
            if not torch.equal(pool.linear_sgemm(xs[i], packed[i], 512), refs[i]):
                bad.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_a_bad_block_id_is_refused_before_the_kernel_and_the_pool_stays_usable(pool):
    """Through the attention backend (its Python checks): a ValueError, no kernel call."""
    import dataclasses

    from tallyserve.attention.cpu_sdpa import CpuSdpaBackend
    from tests.unit.test_attention_ref import make_case

    q, k, v, cache, meta, _, _ = make_case([(37, 1), (100, 20), (0, 9)], 9, 3, 64, 16, seed=4)
    cache.copy_(cache.nan_to_num(0.0))
    ref = CpuSdpaBackend().forward(q, k, v, cache.clone(), meta, 0.125)
    torch.set_num_threads(1)
    pool.set_task_pool_threads(3)
    bad_tables = meta.block_tables.clone()
    bad_tables[1, 0] = 10_000
    with pytest.raises(ValueError, match="block id out of range"):
        CpuSdpaBackend().forward(q, k, v, cache.clone(), dataclasses.replace(meta, block_tables=bad_tables), 0.125)
    assert torch.equal(CpuSdpaBackend().forward(q, k, v, cache.clone(), meta, 0.125), ref)


@RAW_THROW
def test_a_kernel_error_leaves_the_pool_usable(pool):
    q, cache, tables, qsl, seq_lens = paged_case(4)
    ref = pool.paged_attention(q, cache, tables, qsl, seq_lens, 0.125)
    torch.set_num_threads(1)
    pool.set_task_pool_threads(3)
    bad_tables = tables.clone()
    bad_tables[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="block id out of range"):
        pool.paged_attention(q, cache, bad_tables, qsl, seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="probe expects \\(from a task\\)"):  # thrown in a task on the pool
        pool.probe_error(torch.zeros(1), 1)
    assert torch.equal(pool.paged_attention(q, cache, tables, qsl, seq_lens, 0.125), ref)


def test_generation_is_token_for_token_the_same_on_the_pool(pool, tmp_path):
    from tallyserve import LLM, SamplingParams

    # head_dim 64 (the compiled attention's fast paths), two KV heads
    path = make_tiny_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4)
    llm = LLM(model=path, dtype="float32", enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 1 for j in range(5 + 9 * i)]} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    got = on_pool(pool, 5, lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
    assert got == ref
