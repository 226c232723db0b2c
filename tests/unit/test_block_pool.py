"""Exact block ids and free-queue order for the pool, the prefix index and the KV manager."""

import pytest

from tallyserve.core.block_pool import BlockPool
from tallyserve.core.kv_cache_manager import KVCacheManager, KVCopy
from tallyserve.core.prefix_cache import ROOT_HASH, PrefixCache, hash_block
from tallyserve.request import Request
from tallyserve.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def make_req(rid, tokens, max_tokens=4):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def test_pool_allocates_from_head_and_frees_to_tail():
    pool = BlockPool(6, PrefixCache())
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    pool.free_blocks(reversed(b))
    assert pool.free_block_ids() == [5, 4, 3, 2]
    pool.free_blocks(a)
    assert pool.free_block_ids() == [5, 4, 3, 2, 0, 1]
    assert ids(pool.get_new_blocks(3)) == [5, 4, 3]
    pool.check_integrity()


def test_pool_double_free_and_over_allocation_raise():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blk])
    with pytest.raises(ValueError, match="cannot allocate 3"):
        pool.get_new_blocks(3)


def test_cached_free_block_is_evicted_only_when_reallocated():
    pool = BlockPool(3, PrefixCache())
    (blk,) = pool.get_new_blocks(1)
    h = hash_block(ROOT_HASH, [1, 2])
    assert pool.cache_block(blk, h, ROOT_HASH, [1, 2])
    pool.free_blocks([blk])
    assert pool.free_block_ids() == [1, 2, 0]
    assert pool.prefix_cache.lookup(h) is blk  # free but still a hit
    pool.touch([blk])  # a hit pulls it off the queue
    assert pool.free_block_ids() == [1, 2] and blk.ref_cnt == 1
    pool.free_blocks([blk])
    assert ids(pool.get_new_blocks(3)) == [1, 2, 0]
    assert pool.prefix_cache.lookup(h) is None and blk.block_hash is None
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_prefix_cache_partial_match_prefers_longest_then_oldest():
    cache = PrefixCache()
    pool = BlockPool(4, cache)
    blocks = pool.get_new_blocks(3)
    for blk, toks in zip(blocks, ([5, 6, 7, 8], [5, 6, 9, 9], [5, 6, 7, 1])):
        cache.insert(blk, hash_block(ROOT_HASH, toks), ROOT_HASH, toks)
    assert cache.match_partial(ROOT_HASH, [5, 6, 7, 2]) == (blocks[0], 3)
    assert cache.match_partial(ROOT_HASH, [5, 6, 9]) == (blocks[1], 3)
    assert cache.match_partial(ROOT_HASH, [5, 3]) == (blocks[0], 1)
    assert cache.match_partial(ROOT_HASH, [4]) == (None, 0)
    assert cache.match_partial(12345, [5, 6]) == (None, 0)


def test_kv_manager_full_hit_partial_hit_and_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    hit = kv.match_prefix(a)
    assert hit.num_tokens == 0
    assert kv.allocate_slots(a, 10, hit)
    assert kv.block_ids("a") == (0, 1, 2)
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)
    assert kv.pool.num_cached_blocks == 2  # the partial third block is not cached

    # Shares 6 tokens: one full block hit, then 2 tokens of block 1 reused by copy.
    b = make_req("b", [0, 1, 2, 3, 4, 5, 99, 98, 97])
    hit = kv.match_prefix(b)
    assert ids(hit.blocks) == [0] and hit.num_full_tokens == 4
    assert hit.partial_src.block_id == 1 and hit.num_partial_tokens == 2
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert kv.block_ids("b") == (0, 3, 4)
    assert kv.take_transfers().copies == (KVCopy(src=1, dst=3, num_tokens=2),)
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[1].ref_cnt == 2  # shared + pinned source
    kv.release_step()
    assert kv.pool.blocks[1].ref_cnt == 1
    kv.check_integrity()

    # Freed in reverse: tail blocks first in the queue, shared prefix block stays referenced by b.
    kv.free(a)
    assert kv.pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 1]
    kv.free(b)
    assert kv.pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 4, 3, 0]
    kv.check_integrity()


def test_hit_is_capped_so_last_token_is_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(8)))
    assert kv.allocate_slots(a, 8, kv.match_prefix(a))
    kv.cache_blocks(a, 8)
    kv.free(a)
    same = make_req("same", list(range(8)))
    hit = kv.match_prefix(same)
    # Two cached full blocks, but the last token must be recomputed: 1 block + 3 copied tokens.
    assert hit.num_full_tokens == 4 and hit.num_partial_tokens == 3 and hit.num_tokens == 7
    kv_off = KVCacheManager(num_blocks=8, block_size=4, enable_partial_reuse=False)
    assert kv_off.match_prefix(make_req("x", [1])).num_tokens == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_req("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4, kv.match_prefix(a))
    kv.cache_blocks(a, 4)
    kv.free(a)
    before = kv.pool.free_block_ids()
    big = make_req("big", [1, 2, 3, 4, 5, 6, 7, 8])
    hit = kv.match_prefix(big)
    assert hit.num_full_tokens == 4
    # needs 4 blocks in all, the pool has 3: refused, and the hit blocks stay where they were
    assert not kv.allocate_slots(big, big.num_tokens - hit.num_tokens, hit)
    assert kv.pool.free_block_ids() == before
    assert kv.block_ids("big") == ()
    kv.check_integrity()


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_req("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3, kv.match_prefix(a))
    kv.cache_blocks(a, 3)
    kv.free(a)
    assert kv.match_prefix(make_req("b", [1, 2, 3])).num_tokens == 0
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
