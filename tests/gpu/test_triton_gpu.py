"""Triton paged attention on the GPU at full size against the torch reference, and model parity
with Hugging Face transformers on a tiny random model. Skipped without CUDA.

Shapes follow the served presets (Llama-3-8B / Qwen3-8B / Mistral-Nemo: 32 query heads, 8 KV
heads, head_dim 128) plus head_dim 64 and 256, in bf16, fp16 and fp32. Each case poisons the
output with NaN (every element must be written), compares the cache the Triton write kernel
produced with the reference write (padding rows, slot -1, write nothing), and checks the
attention output with a tolerance relative to the output's scale.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models
from tiny_models import PagedKV, load_hf_model, make_tiny_model  # noqa: E402

from tallyserve.attention.backend import get_attn_backend, get_kv_cache_shape  # noqa: E402
from tallyserve.attention.metadata import AttentionMetadata  # noqa: E402

REL_TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
DEV = torch.device("cuda")


def make_case(reqs, hq, hkv, dim, bs, dtype, seed=0, num_padding=0, num_blocks=None, width=None, shared_blocks=0):
    """reqs: [(cached_len, query_len)]: the cached prefixes are written into a NaN-filled cache
    through shuffled block tables; returns q, k, v (new rows + padding rows), cache, metadata.
    ``shared_blocks``: every request's first blocks are the same blocks (one prefix, as prefix
    caching shares it); the metadata then names that prefix for cascade attention."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    num_blocks = num_blocks or sum(-(-(c + n) // bs) for c, n in reqs) + 8
    cache = torch.full(get_kv_cache_shape(num_blocks, bs, hkv, dim), float("nan"), dtype=dtype, device=DEV)
    flat = cache.view(2, -1, hkv, dim)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    shared = [free.pop() for _ in range(shared_blocks)]
    qs, ks, vs, slots, starts, tables = [], [], [], [], [0], []
    for cached, new in reqs:
        total = cached + new
        table = shared + [free.pop() for _ in range(-(-total // bs) - len(shared))]
        tables.append(table)
        pos = torch.arange(total, device=DEV)
        req_slots = torch.tensor(table, device=DEV)[pos // bs] * bs + pos % bs
        k = torch.randn(total, hkv, dim, generator=gen, device=DEV).to(dtype)
        v = torch.randn(total, hkv, dim, generator=gen, device=DEV).to(dtype)
        flat[0, req_slots[:cached]] = k[:cached]
        flat[1, req_slots[:cached]] = v[:cached]
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots.append(req_slots[cached:])
        qs.append(torch.randn(new, hq, dim, generator=gen, device=DEV).to(dtype))
        starts.append(starts[-1] + new)
    qs.append(torch.randn(num_padding, hq, dim, generator=gen, device=DEV).to(dtype))
    ks.append(torch.randn(num_padding, hkv, dim, generator=gen, device=DEV).to(dtype))
    vs.append(torch.randn(num_padding, hkv, dim, generator=gen, device=DEV).to(dtype))
    slots.append(torch.full((num_padding,), -1, device=DEV))
    width = width or max(len(t) for t in tables)
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).long(),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens), block_size=bs,
        max_query_len=max(n for _, n in reqs), max_seq_len=max(seq_lens),
        common_prefix_len=shared_blocks * bs,
        prefix_kv_lens=torch.tensor([shared_blocks * bs], dtype=torch.int32, device=DEV) if shared_blocks else None,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta


def check_case(reqs, hq, hkv, dim, bs, dtype, seed=0, num_padding=0, config=None, shared_blocks=0):
    from tallyserve.attention import torch_ref
    from tallyserve.attention.triton_attn import KernelConfig, paged_attention
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    q, k, v, cache, meta = make_case(reqs, hq, hkv, dim, bs, dtype, seed, num_padding, shared_blocks=shared_blocks)
    scale = dim ** -0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()
    n = meta.num_tokens
    torch_ref.write_kv_cache(k[:n], v[:n], ref_cache, meta.slot_mapping[:n])
    write_kv_cache(k, v, tri_cache, meta.slot_mapping)
    assert torch.equal(ref_cache.isnan(), tri_cache.isnan()), "a padding row was written, or a real row was not"
    assert torch.equal(ref_cache.nan_to_num(0), tri_cache.nan_to_num(0))
    ref = torch_ref.paged_attention(q, ref_cache, meta, scale).float()
    out = torch.full_like(q, float("nan"))
    paged_attention(q, tri_cache, meta, scale, out=out, config=config or KernelConfig())
    assert out.isfinite().all(), "an output element was not written"
    assert (out[n:] == 0).all()
    err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    assert err <= REL_TOL[dtype], f"relative error {err:.3g} > {REL_TOL[dtype]}"
    return err


def _mixed(seed, num_prefill, num_decode, max_ctx, max_chunk):
    rng = random.Random(seed)
    reqs = [(rng.choice([0, rng.randint(1, max_ctx)]), rng.randint(2, max_chunk)) for _ in range(num_prefill)]
    reqs += [(rng.randint(0, max_ctx), 1) for _ in range(num_decode)]
    rng.shuffle(reqs)
    return reqs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_llama8b_shape_mixed_batch(dtype):
    reqs = [(0, 1024), (3000, 512), (100, 2048), (4095, 77)] + _mixed(0, 3, 64, 4096, 300)
    check_case(reqs, 32, 8, 128, 16, dtype, num_padding=5)


@pytest.mark.parametrize("dim,hq,hkv,bs", [(64, 16, 16, 32), (64, 32, 4, 16), (256, 8, 2, 16), (128, 28, 4, 16)])
def test_head_dims_and_groups(dim, hq, hkv, bs):
    check_case(_mixed(dim + hq, 4, 24, 2000, 700), hq, hkv, dim, bs, torch.bfloat16, num_padding=3)


@pytest.mark.parametrize("num_reqs,ctx", [(1, 8191), (1, 100), (4, 5000), (256, 2048)])
def test_decode_only_split_k(num_reqs, ctx):
    """Auto split count (fills the SMs at small batch), pure decode steps as CUDA graphs run them."""
    rng = random.Random(num_reqs)
    check_case([(rng.randint(ctx // 2, ctx), 1) for _ in range(num_reqs)], 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("num_reqs,prefix_blocks,own", [(128, 128, 64), (8, 16, 3000), (256, 32, 1), (33, 256, 700)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cascade_decode_over_shared_prefix(num_reqs, prefix_blocks, own, dtype):
    """Decode rows whose first blocks are one shared prefix: the prefix attended once for all rows
    (cascade) equals the reference, and equals each row reading it itself within rounding."""
    import dataclasses

    from tallyserve.attention.triton_attn import paged_attention
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    rng = random.Random(num_reqs)
    reqs = [(prefix_blocks * 16 + rng.randint(0, own - 1), 1) for _ in range(num_reqs)]
    check_case(reqs, 32, 8, 128, 16, dtype, shared_blocks=prefix_blocks)
    q, k, v, cache, meta = make_case(reqs, 32, 8, 128, 16, dtype, shared_blocks=prefix_blocks)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    cascade = paged_attention(q, cache, meta, 128 ** -0.5).float()
    plain = paged_attention(q, cache, dataclasses.replace(meta, common_prefix_len=0, prefix_kv_lens=None),
                            128 ** -0.5).float()
    assert (cascade - plain).abs().max().item() <= REL_TOL[dtype] * plain.abs().max().item()


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("splits", [None, 2])
def test_decode_grid_orders(heads_first, splits):
    """The decode grid ordered (KV heads, requests, splits), the default, and (requests, KV heads, splits)
    both give the reference's output."""
    from tallyserve.attention.triton_attn import KernelConfig

    rng = random.Random(11)
    reqs = [(rng.randint(256, 1280), 1) for _ in range(256)] + [(rng.randint(1, 300), 1) for _ in range(5)]
    check_case(reqs, 32, 8, 128, 16, torch.bfloat16, num_padding=2,
               config=KernelConfig(decode_heads_first=heads_first, num_splits=splits))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 37, 8192])
def test_rotary_kv_write_kernel_matches_the_rotary_kernels(qk_norm, tokens):
    """rotary (+ Qwen3's q/k norm) and the KV write in one kernel against the rotary kernels: q and k within
    bf16 rounding (the compiler may contract a product and a sum into one FMA in one kernel and not in the
    other, and sum a head's squares in another order; the interpreter test compares bits), v bit-equal; the
    cache holds exactly the k and v the kernel left in qkv, at the real rows' slots, and nothing else changed."""
    from tallyserve.kernels import fused_ops

    g = torch.Generator(device=DEV).manual_seed(tokens)
    hq, hkv, d = 32, 8, 128
    qkv = torch.randn(tokens, hq + 2 * hkv, d, generator=g, device=DEV).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (tokens,), generator=g, device=DEV).float()
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = emb.cos(), emb.sin()
    qw = (1 + 0.1 * torch.randn(d, generator=g, device=DEV)).to(torch.bfloat16)
    kw = (1 - 0.1 * torch.randn(d, generator=g, device=DEV)).to(torch.bfloat16)
    num_blocks = tokens // 16 + 4
    slots = torch.randperm(num_blocks * 16, generator=g, device=DEV)[:tokens]
    slots[::5] = -1
    cache = torch.randn(2, num_blocks, 16, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
    want_qkv = qkv.clone()
    if qk_norm:
        fused_ops.qk_norm_rotary_(want_qkv[:, :hq + hkv], qw, kw, hq, 1e-6, cos, sin)
    else:
        fused_ops.rotary_(want_qkv[:, :hq + hkv], cos, sin)
    before = cache.clone()
    fused_ops.rotary_write_kv_(qkv, hq, hkv, cos, sin, cache, slots, *((qw, kw, 1e-6) if qk_norm else ()))
    got, want = qkv[:, :hq + hkv].float(), want_qkv[:, :hq + hkv].float()
    assert ((got - want).abs() <= 2.0 ** -6 * want.abs().amax(-1, keepdim=True)).all()  # two bf16 ulps of the head
    assert torch.equal(qkv[:, hq + hkv:], want_qkv[:, hq + hkv:])
    real = slots >= 0
    flat, flat_before = cache.view(2, -1, hkv, d), before.view(2, -1, hkv, d)
    assert torch.equal(flat[0, slots[real]], qkv[real, hq:hq + hkv])
    assert torch.equal(flat[1, slots[real]], qkv[real, hq + hkv:])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots[real]] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_forced_splits_match():
    from tallyserve.attention.triton_attn import KernelConfig

    for splits in (1, 2, 8, 32):
        check_case([(3000, 1), (17, 1), (0, 1)], 32, 8, 128, 16, torch.float32, config=KernelConfig(num_splits=splits))


def test_backend_forward_in_cuda_graph_reads_lengths_from_device():
    """Capture one decode step, then replay it on a different batch (other lengths, slots and block
    tables copied into the same tensors): the output matches the reference for the new batch."""
    import dataclasses

    from tallyserve.attention import torch_ref
    from tallyserve.attention.triton_attn import TritonAttentionBackend

    shape = dict(hq=32, hkv=8, dim=128, bs=16, dtype=torch.bfloat16, num_blocks=400, width=160)
    qa, ka, va, cache, meta = make_case([(500, 1), (30, 1), (1200, 1)], seed=1, **shape)
    qb, kb, vb, cache_b, meta_b = make_case([(90, 1), (2000, 1), (7, 1)], seed=2, **shape)
    meta = dataclasses.replace(meta, max_seq_len=160 * 16)  # the capture-time bound
    backend = TritonAttentionBackend()
    backend.forward(qa, ka, va, cache.clone(), meta, 0.1)  # warm-up: compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(qa, ka, va, cache, meta, 0.1)
    for dst, src in ((qa, qb), (ka, kb), (va, vb), (cache, cache_b), (meta.slot_mapping, meta_b.slot_mapping),
                     (meta.seq_lens, meta_b.seq_lens), (meta.block_tables, meta_b.block_tables)):
        dst.copy_(src)
    graph.replay()
    ref_cache = cache_b.clone()
    ref = torch_ref.TorchRefBackend().forward(qb, kb, vb, ref_cache, meta_b, 0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache.nan_to_num(0), ref_cache.nan_to_num(0))


# --------------------------------------------------------------------------- model parity
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gpu_parity"), "llama", num_attention_heads=4,
                           num_key_value_heads=2)
    return path, load_hf_model(path)


def _ours(path, dtype):
    from tallyserve.models.loader import load_model, resolve_model

    return load_model(resolve_model(path, "auto"), "auto", dtype, DEV, 0, get_attn_backend("triton"))


def _step(kv, model, batch):
    import dataclasses

    ids, pos, meta = kv.build(batch)
    meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(DEV), query_start_loc=meta.query_start_loc.to(DEV),
                               seq_lens=meta.seq_lens.to(DEV), block_tables=meta.block_tables.to(DEV))
    with torch.inference_mode():
        return model.compute_logits(model(ids.to(DEV), pos.to(DEV), kv.kv_caches, meta)).cpu()


def test_model_parity_fp32_chunked_prefill_and_decode(tiny):
    path, hf = tiny
    model = _ours(path, torch.float32)
    kv = PagedKV(model, num_blocks=64, block_size=16, seed=0)
    kv.kv_caches = [c.to(DEV) for c in kv.kv_caches]
    tokens = [random.Random(5).randrange(3, 250) for _ in range(60)]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    got = [_step(kv, model, [("a", tokens[:23])]), _step(kv, model, [("a", tokens[23:50])])]
    got += [_step(kv, model, [("a", [t])]) for t in tokens[50:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-3, rtol=1e-3)


def test_model_parity_bf16_first_step(tiny):
    path, hf = tiny
    model = _ours(path, torch.bfloat16)
    kv = PagedKV(model, num_blocks=64, block_size=16, seed=0, dtype=torch.bfloat16)
    kv.kv_caches = [c.to(DEV) for c in kv.kv_caches]
    tokens = [random.Random(6).randrange(3, 250) for _ in range(40)]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    got = _step(kv, model, [("a", tokens)])
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < 5e-2, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
