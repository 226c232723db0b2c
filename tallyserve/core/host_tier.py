"""HostKVTier: a second, larger pool of KV blocks in host memory, indexed by block hash.

A cached device block that the device pool evicts is copied here instead of dropped; a later
prompt whose prefix matches it gets the block copied back instead of recomputed. Host blocks
being restored in a step are pinned so no offload of the same step can overwrite them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional


class HostKVTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> host block, oldest first
        self._hash_of: dict[int, int] = {}  # host block -> block hash
        self._pins: dict[int, int] = {}  # host block -> pin count
        self.num_offloaded = 0
        self.num_dropped = 0  # evicted from the host tier too

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, block_hash: int) -> Optional[int]:
        return self._lru.get(block_hash)

    def offload(self, block_hash: int) -> Optional[int]:
        """Take a host block for an evicted device block; None if none is needed or free.

        The caller copies the device block into the returned host block before anything
        overwrites the device block.
        """
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        host = self._take_block()
        if host is None:
            return None
        self._lru[block_hash] = host
        self._hash_of[host] = block_hash
        self.num_offloaded += 1
        return host

    def _take_block(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        for old_hash, host in self._lru.items():  # oldest first; pinned blocks are skipped
            if host not in self._pins:
                del self._lru[old_hash]
                del self._hash_of[host]
                self.num_dropped += 1
                return host
        return None

    def pin(self, hosts: Iterable[int]) -> None:
        for h in hosts:
            self._pins[h] = self._pins.get(h, 0) + 1
            self._lru.move_to_end(self._hash_of[h])

    def unpin(self, hosts: Iterable[int]) -> None:
        for h in hosts:
            n = self._pins[h] - 1
            if n:
                self._pins[h] = n
            else:
                del self._pins[h]

    def discard(self, hosts: Iterable[int]) -> None:
        """Forget blocks whose offload copy never ran (a failed step)."""
        for h in hosts:
            block_hash = self._hash_of.pop(h, None)
            if block_hash is not None:
                del self._lru[block_hash]
                self._free.append(h)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def check_integrity(self) -> None:
        """free + cached == total, the two maps agree, and pins only on cached blocks."""
        if len(self._free) + len(self._lru) != self.num_blocks:
            raise AssertionError("host tier: free + cached != total")
        if set(self._free) & set(self._hash_of):
            raise AssertionError("host tier: a block is both free and cached")
        for block_hash, host in self._lru.items():
            if self._hash_of.get(host) != block_hash:
                raise AssertionError(f"host tier: block {host} indexed under a stale hash")
        if any(h not in self._hash_of for h in self._pins):
            raise AssertionError("host tier: a pinned block is not cached")
