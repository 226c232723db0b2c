"""BlockPool: KV blocks, reference counts and the LRU free queue. It knows no requests.

Free queue order is the eviction order: `get_new_blocks` takes from the head, `free_blocks`
appends to the tail. A freed block keeps its prefix-cache entry (it is "cached": free but
reusable by a hit) until it is handed out again, at which point the entry is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

from tallyserve.core.prefix_cache import PrefixCache


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: Optional[PrefixCache] = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.prefix_cache = prefix_cache
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.num_evictions = 0
        # Called as on_evict(block_id, block_hash) when a cached block is handed out again.
        self.on_evict: Optional[Callable[[int, int], None]] = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never-used, plain free and evictable cached blocks."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return 0 if self.prefix_cache is None else len(self.prefix_cache)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (evicted next) first."""
        return list(self._free)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted_hash = block.block_hash
                self.prefix_cache.remove(block)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block.block_id, evicted_hash)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (pulling free ones off the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each, in the order given; unreferenced blocks join the queue tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: int, parent_hash: int, token_ids: Sequence[int]) -> bool:
        if self.prefix_cache is None or block.block_hash is not None:
            return False
        return self.prefix_cache.insert(block, block_hash, parent_hash, token_ids)

    def check_integrity(self) -> None:
        """free + cached + in use == total, and every block is in exactly one of those states."""
        num_free = num_cached_free = num_used = 0
        for block in self.blocks:
            in_queue = block.block_id in self._free
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != in_queue:
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue {in_queue}")
            if block.ref_cnt > 0:
                num_used += 1
            elif block.block_hash is not None:
                num_cached_free += 1
            else:
                num_free += 1
            if block.block_hash is not None and (
                self.prefix_cache is None or self.prefix_cache.lookup(block.block_hash) is not block
            ):
                raise AssertionError(f"block {block.block_id} carries a hash the index does not map to it")
        if num_free + num_cached_free + num_used != self.num_blocks:
            raise AssertionError("free + cached + in use != total")
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            if len(self.prefix_cache) != sum(b.block_hash is not None for b in self.blocks):
                raise AssertionError("prefix index holds blocks the pool does not mark cached")
