"""KVCacheManager: request-level block bookkeeping on top of the BlockPool.

Prefix reuse follows ledger rule 2: `match_prefix` finds the hit (full cached blocks plus,
with partial reuse, the cached block sharing the most leading tokens of the next block), and
`allocate_slots` commits exactly that hit (pins the blocks, allocates the rest, queues the
partial-block copy) atomically, before the scheduler charges a single token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tallyserve.core.block_pool import BlockPool, KVCacheBlock
from tallyserve.core.host_tier import HostKVTier
from tallyserve.core.prefix_cache import ROOT_HASH, PrefixCache, hash_block
from tallyserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCopy:
    """Copy the first `num_tokens` slots of block `src` into block `dst` before the forward pass.

    Device-to-device for partial reuse; device-to-host (offload) and host-to-device (restore)
    for the host tier, where src / dst name a block of the pool on each side.
    """

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class KVTransfers:
    """The block moves of one step, run in this order before the forward pass."""

    offloads: tuple[KVCopy, ...] = ()  # device -> host: evicted cached blocks
    restores: tuple[KVCopy, ...] = ()  # host -> device: host-tier prefix hits
    copies: tuple[KVCopy, ...] = ()  # device -> device: partial-block reuse

    def __bool__(self) -> bool:
        return bool(self.offloads or self.restores or self.copies)


@dataclass(frozen=True)
class PrefixHit:
    # One entry per full block hit, in order: the cached device block, or None where the
    # block comes back from the host tier (its host block is the next of `host_blocks`).
    blocks: tuple[Optional[KVCacheBlock], ...] = ()
    num_full_tokens: int = 0
    partial_src: Optional[KVCacheBlock] = None  # cached block whose leading tokens we reuse
    num_partial_tokens: int = 0
    host_blocks: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_full_tokens + self.num_partial_tokens

    @property
    def device_blocks(self) -> list[KVCacheBlock]:
        return [b for b in self.blocks if b is not None]

    def without_partial(self) -> "PrefixHit":
        """The same hit minus the partial block (whose pinned source costs one extra block)."""
        return PrefixHit(self.blocks, self.num_full_tokens, None, 0, self.host_blocks)


NO_HIT = PrefixHit()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        enable_partial_reuse: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_partial_reuse = enable_prefix_caching and enable_partial_reuse
        self.pool = BlockPool(num_blocks, PrefixCache() if enable_prefix_caching else None)
        self.host = HostKVTier(num_host_blocks) if enable_prefix_caching and num_host_blocks else None
        if self.host is not None:
            self.pool.on_evict = self._offload
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same tables as ints (read every step)
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already indexed
        self._copies: list[KVCopy] = []
        self._offloads: list[KVCopy] = []
        self._restores: list[KVCopy] = []
        self._copy_sources: list[KVCacheBlock] = []  # pinned until the step that copies them ran
        self._pinned_host: list[int] = []  # host blocks being restored this step

    # ----------------------------------------------------------------- queries
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._req_block_ids.get(request_id, ()))

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------- prefix
    def _update_block_hashes(self, request: Request) -> None:
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(len(hashes), request.num_resolved_tokens // bs):  # never over a placeholder
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))

    def match_prefix(self, request: Request) -> PrefixHit:
        """The longest reusable prefix of a waiting request. Pure: changes no block state.

        Capped at num_tokens - 1 so the last token is always computed and yields logits. None for a
        request with prompt_logprobs before its first output token: a cached block holds KV, not the
        logits of its positions, so every prompt position is computed (its blocks are still published).
        """
        if not self.enable_prefix_caching or (
                request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 0):
            return NO_HIT
        self._update_block_hashes(request)
        bs, cache = self.block_size, self.pool.prefix_cache
        max_hit = request.num_tokens - 1
        blocks: list[Optional[KVCacheBlock]] = []
        host_blocks: list[int] = []
        for i, block_hash in enumerate(request.block_hashes):
            if (i + 1) * bs > max_hit:
                break
            block = cache.lookup(block_hash)
            if block is None:
                host = self.host.lookup(block_hash) if self.host is not None else None
                if host is None:
                    break
                host_blocks.append(host)
            blocks.append(block)
        num_full = len(blocks) * bs
        src, num_partial = None, 0
        limit = min(bs, max_hit - num_full)
        if self.enable_partial_reuse and limit > 0:
            parent = request.block_hashes[len(blocks) - 1] if blocks else ROOT_HASH
            src, num_partial = cache.match_partial(parent, request.all_token_ids[num_full:num_full + limit])
        return PrefixHit(tuple(blocks), num_full, src, num_partial, tuple(host_blocks))

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[PrefixHit] = None) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens; commit `hit` on first admission.

        All or nothing: False (and no state changed) when the pool cannot supply the blocks.
        """
        if hit is not None:
            return self._admit(request, num_new_tokens, hit)
        blocks = self._req_blocks.setdefault(request.request_id, [])
        need = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            new = self.pool.get_new_blocks(need)
            blocks.extend(new)
            self._req_block_ids.setdefault(request.request_id, []).extend(b.block_id for b in new)
        return True

    def _admit(self, request: Request, num_new_tokens: int, hit: PrefixHit) -> bool:
        if request.request_id in self._req_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        device_hits = hit.device_blocks
        need = self.num_blocks_needed(hit.num_tokens + num_new_tokens) - len(device_hits)
        pinned = device_hits + ([hit.partial_src] if hit.partial_src is not None else [])
        # Hit blocks still on the free queue are counted as free but must not be handed out.
        evictable = sum(1 for b in set(pinned) if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable:
            return False
        self.pool.touch(pinned)
        if hit.host_blocks:
            self.host.pin(hit.host_blocks)  # before allocating: offloads must not reuse them
            self._pinned_host.extend(hit.host_blocks)
        new_blocks = iter(self.pool.get_new_blocks(need))
        table: list[KVCacheBlock] = []
        hosts = iter(hit.host_blocks)
        for block in hit.blocks:
            if block is None:
                block = next(new_blocks)
                self._restores.append(KVCopy(next(hosts), block.block_id, self.block_size))
            table.append(block)
        rest = list(new_blocks)
        if hit.partial_src is not None:
            self._copy_sources.append(hit.partial_src)
            self._copies.append(KVCopy(hit.partial_src.block_id, rest[0].block_id, hit.num_partial_tokens))
        self._req_blocks[request.request_id] = table + rest
        self._req_block_ids[request.request_id] = [b.block_id for b in table + rest]
        leading = next((i for i, b in enumerate(hit.blocks) if b is None), len(hit.blocks))
        self._num_cached_blocks[request.request_id] = leading
        return True

    def fork(self, parent: Request, child: Request) -> bool:
        """Give `child` the parent's computed KV: full blocks shared by reference, the partially
        filled last block copied (copy-on-write). False (nothing changed) if no block is free."""
        if child.request_id in self._req_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = self._req_blocks.get(parent.request_id, [])
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return False
        table = blocks[:num_full]
        self.pool.touch(table)
        if partial:
            src = blocks[num_full]
            self.pool.touch([src])  # pinned until the step that copies it has run
            self._copy_sources.append(src)
            (dst,) = self.pool.get_new_blocks(1)
            self._copies.append(KVCopy(src.block_id, dst.block_id, partial))
            table = table + [dst]
        self._req_blocks[child.request_id] = list(table)
        self._req_block_ids[child.request_id] = [b.block_id for b in table]
        self._num_cached_blocks[child.request_id] = min(self._num_cached_blocks.get(parent.request_id, 0), num_full)
        return True

    def _offload(self, block_id: int, block_hash: int) -> None:
        host = self.host.offload(block_hash)
        if host is not None:
            self._offloads.append(KVCopy(block_id, host, self.block_size))

    def take_transfers(self) -> KVTransfers:
        """Block moves queued since the last call (they go into the SchedulerOutput)."""
        out = KVTransfers(tuple(self._offloads), tuple(self._restores), tuple(self._copies))
        self._offloads, self._restores, self._copies = [], [], []
        return out

    def release_step(self) -> None:
        """Unpin copy sources and host blocks once the step that moved them has run."""
        sources, self._copy_sources = self._copy_sources, []
        self.pool.free_blocks(sources)
        if self._pinned_host:
            self.host.unpin(self._pinned_host)
            self._pinned_host = []

    def discard_offloads(self, offloads: tuple[KVCopy, ...]) -> None:
        """A step whose transfers never ran: forget the host copies it promised."""
        if self.host is not None:
            self.host.discard(c.dst for c in offloads)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if blocks is None:
            return
        start, end = self._num_cached_blocks.get(rid, 0), num_computed_tokens // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request)
        bs, tokens = self.block_size, request.all_token_ids
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else ROOT_HASH
            self.pool.cache_block(blocks[i], request.block_hashes[i], parent, tokens[i * bs:(i + 1) * bs])
        if end > start:
            self._num_cached_blocks[rid] = end

    def uncached_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the request's full blocks within its first ``num_tokens`` that are not indexed
        yet: KV that a scheduled or in-flight step is computing."""
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens, request.num_resolved_tokens) // self.block_size
        if end <= start:
            return []
        self._update_block_hashes(request)
        return request.block_hashes[start:end]

    def free(self, request: Request) -> None:
        """Return a request's blocks; tail blocks first, so they are evicted before shared prefixes."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def check_integrity(self) -> None:
        """Pool integrity, and every reference is held by a request or a pinned copy source."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, blocks in self._req_blocks.items():
            if self._req_block_ids.get(rid, []) != [b.block_id for b in blocks]:
                raise AssertionError(f"request {rid!r}: block id table out of sync")
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self._copy_sources:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            if b.ref_cnt != refs.get(b.block_id, 0):
                raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs.get(b.block_id, 0)} holders")
        if self.host is not None:
            self.host.check_integrity()
            if self.host.num_pinned != len(set(self._pinned_host)):
                raise AssertionError("host tier: pins held outside a step")
