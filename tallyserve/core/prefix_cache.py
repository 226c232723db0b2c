"""Prefix index over cached KV blocks: chained block hashes plus a children index.

A full block's hash chains its parent's hash with its own token ids, so equal hashes mean
equal prefixes. The children index (parent hash -> first token -> blocks) finds, for a
prompt whose next block is not cached whole, the cached block sharing the longest run of
leading tokens with it: the partial-reuse source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from tallyserve.core.block_pool import KVCacheBlock

# Parent hash of a request's first block. A fixed int keeps hashes identical across processes.
ROOT_HASH = 0x7A11_5E7E


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block. Python's int/tuple hash is deterministic across runs."""
    return hash((parent_hash, tuple(token_ids)))


class _Entry:
    __slots__ = ("block", "parent_hash", "token_ids")

    def __init__(self, block: "KVCacheBlock", parent_hash: int, token_ids: tuple[int, ...]) -> None:
        self.block = block
        self.parent_hash = parent_hash
        self.token_ids = token_ids


class PrefixCache:
    def __init__(self) -> None:
        self._by_hash: dict[int, _Entry] = {}
        # parent hash -> first token id -> {block id: entry}, in insertion order.
        self._children: dict[int, dict[int, dict[int, _Entry]]] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: int) -> Optional["KVCacheBlock"]:
        entry = self._by_hash.get(block_hash)
        return None if entry is None else entry.block

    def insert(self, block: "KVCacheBlock", block_hash: int, parent_hash: int, token_ids: Sequence[int]) -> bool:
        """Index a full, computed block. False (and nothing changes) if the hash is already cached."""
        if block_hash in self._by_hash:
            return False
        entry = _Entry(block, parent_hash, tuple(token_ids))
        self._by_hash[block_hash] = entry
        self._children.setdefault(parent_hash, {}).setdefault(entry.token_ids[0], {})[block.block_id] = entry
        block.block_hash = block_hash
        return True

    def remove(self, block: "KVCacheBlock") -> None:
        """Drop an evicted block from the index."""
        entry = self._by_hash.pop(block.block_hash)
        by_first = self._children[entry.parent_hash]
        siblings = by_first[entry.token_ids[0]]
        del siblings[block.block_id]
        if not siblings:
            del by_first[entry.token_ids[0]]
            if not by_first:
                del self._children[entry.parent_hash]
        block.block_hash = None

    def match_partial(self, parent_hash: int, token_ids: Sequence[int]) -> tuple[Optional["KVCacheBlock"], int]:
        """The cached child of `parent_hash` sharing the most leading tokens with `token_ids`.

        Returns (block, n) with 0 < n <= len(token_ids), or (None, 0). Ties go to the block
        cached first, so the choice is deterministic.
        """
        if not token_ids:
            return None, 0
        candidates = self._children.get(parent_hash, {}).get(token_ids[0])
        if not candidates:
            return None, 0
        best, best_len, limit = None, 0, len(token_ids)
        for entry in candidates.values():
            n = _common_prefix_len(entry.token_ids, token_ids, limit)
            if n > best_len:
                best, best_len = entry.block, n
                if n == limit:
                    break
        return best, best_len

    def check_integrity(self) -> None:
        for block_hash, entry in self._by_hash.items():
            if entry.block.block_hash != block_hash:
                raise AssertionError(f"block {entry.block.block_id} indexed under a stale hash")
            if self._children[entry.parent_hash][entry.token_ids[0]].get(entry.block.block_id) is not entry:
                raise AssertionError(f"block {entry.block.block_id} missing from the children index")
        n_children = sum(len(s) for by_first in self._children.values() for s in by_first.values())
        if n_children != len(self._by_hash):
            raise AssertionError("children index and hash index disagree")


def _common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n
