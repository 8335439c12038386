"""Block tables: which pool blocks hold each request's KV, and prefix-cache lookups."""

from __future__ import annotations

from pagedbatch.engine.block_pool import Block, BlockHash, BlockPool, hash_block, salt_root
from pagedbatch.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[Block]] = {}
        # Hashes of the request's full blocks, extended as tokens arrive; they survive preemption.
        self._hashes: dict[str, list[BlockHash]] = {}

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
            parent = hashes[-1] if hashes else salt_root(request.cache_salt)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
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
        blocks.extend(cached)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if cached or request.num_computed_tokens == 0:
            # A fresh admission: count its prefix lookup.
            self.pool.prefix_queries += request.num_tokens
            self.pool.prefix_hits += len(cached) * self.block_size
        if self.enable_caching:
            # Register the blocks this step fills; their tokens are known, their KV is written in
            # this step before anyone can read it.
            num_full = (num_computed + num_new_tokens) // self.block_size
            hashes = self._full_block_hashes(request, num_computed + num_new_tokens)
            for block, h in zip(blocks[:num_full], hashes, strict=False):
                self.pool.cache(block, h)
        return True

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))

    def forget(self, request: Request) -> None:
        """Drop everything kept about a finished request."""
        self.free(request)
        self._hashes.pop(request.request_id, None)
