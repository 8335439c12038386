"""Which pool blocks hold each request's KV, and prefix-cache lookups.

Per step, a running request costs what it gains: its new blocks (appended to its block-table
row) and the blocks it fills (hashed and put in the prefix-cache index), never a walk over the
blocks it already had. Invariants per request holding blocks: the first `_num_registered`
of its blocks have been offered to the prefix-cache index, and `_hashes` holds the hashes of at
least that many of its full blocks (they survive preemption; the registration does not).
"""

from __future__ import annotations

import struct

from pagedbatch.engine.core.block_pool import Block, BlockHash, BlockPool, hash_block, salt_root
from pagedbatch.engine.core.block_table import BlockTable
from pagedbatch.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _media_in(request: Request, start: int, end: int) -> bytes:
    """The images and clips whose placeholders overlap positions [start, end): each one's
    content hash and where it starts relative to `start`."""
    return b"".join(
        item.content_hash + struct.pack("<q", item.offset - start)
        for item in request.media
        if item.offset < end and item.end > start
    )


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[Block]] = {}
        # Hashes of the request's full blocks, extended as tokens arrive; they survive preemption.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self.block_table = BlockTable()

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else salt_root(request.cache_salt, request.lora_key)
            start, end = i * bs, (i + 1) * bs
            extra = _media_in(request, start, end) if request.media else b""
            hashes.append(hash_block(parent, tokens[start:end], extra))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached blocks matching the request's tokens, for a request that holds no
        blocks. At least one token is left to compute, since sampling needs its logits."""
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in self._full_block_hashes(request, request.num_tokens)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens after `cached` (prefix hits that
        the request is about to adopt). False, changing nothing, if the pool is short."""
        blocks = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(cached)
        # Cached blocks nobody holds sit in the free queue: adopting them uses up free blocks too.
        idle_cached = sum(1 for b in cached if b.ref_count == 0)
        if need + idle_cached > self.pool.num_free_blocks:
            return False
        self.pool.touch(cached)
        new = list(cached)
        if need > 0:
            new += self.pool.allocate(need)
        if new:
            blocks.extend(new)
            self.block_table.append(request.request_id, [b.block_id for b in new])
        if cached or request.num_computed_tokens == 0:
            # A fresh admission: count its prefix lookup.
            self.pool.prefix_queries += request.num_tokens
            self.pool.prefix_hits += len(cached) * self.block_size
        if self.enable_caching:
            self._register_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def _register_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        """Put the blocks that the first `num_tokens` tokens fill, and that are not there yet, in
        the prefix-cache index; their tokens are known, and their KV is written in this step
        before anyone can read it."""
        num_full = num_tokens // self.block_size
        first = self._num_registered.get(request.request_id, 0)
        if num_full <= first:
            return
        hashes = self._full_block_hashes(request, num_tokens)
        for i in range(first, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.block_table.release(request.request_id)
        self.pool.free(reversed(blocks))

    def forget(self, request: Request) -> None:
        """Drop everything kept about a finished request."""
        self.free(request)
        self._hashes.pop(request.request_id, None)
