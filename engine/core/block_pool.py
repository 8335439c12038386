"""The pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache index.

A block that is freed keeps its contents. If it was full (and so has a hash), it stays findable by
that hash until it is handed out again; blocks are handed out from the front of the free queue, so
the least recently freed cached blocks are evicted first.

Invariants of the hashes: a block's hash covers its tokens, all the tokens before it (through its
predecessor's hash) and the request's cache salt and LoRA adapter (through the first block's):
two requests share a cached block only if they agree on all of them. So requests salted per
tenant never hit blocks that another tenant's prompts filled, and cannot learn from
`cached_tokens` what it sent; and an adapter's requests never read KV that another computed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of a full block, chained from its predecessor so equal hashes mean equal prefixes.

    The first block of a salted request chains from `salt_root(salt)`, that of an unsalted one
    from nothing (a shorter input than any salted or chained block's). `extra` is what the
    tokens do not say of the block's content: the images or clips whose placeholders it holds
    (their tokens are all alike), so that only the same item at the same place hits."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


def salt_root(salt: str | None, lora_name: str | None = None) -> BlockHash | None:
    """What a request's first block chains from: its cache salt and its LoRA adapter (whose KV
    differs from the base model's for the same tokens), hashed apart from any block."""
    if lora_name is not None:
        key = json.dumps([salt, lora_name]).encode()
        return hashlib.blake2b(key, digest_size=16, person=b"lora-salt").digest()
    if salt is None:
        return None
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache-salt").digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        # None for an encoder, which keeps no KV cache (see Scheduler.encoder_only).
        if num_blocks < 0:
            raise ValueError(f"num_kv_blocks must not be negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered oldest-freed first; values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # Blocks handed out at least once. Never-used blocks lead the free queue in id order and
        # freed ones join behind them, so these are blocks 0 .. blocks_ever_used - 1: the part of
        # the cache ever written (on the CPU, the rest of its pages were never touched).
        self.blocks_ever_used = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.blocks_ever_used = max(self.blocks_ever_used, block_id + 1)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                # Evicting: its old contents are about to be overwritten.
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks found by lookup (pulling free ones off the queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; the caller passes the tail first so that the end of
        a sequence, the least likely part to be shared, is evicted first."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Register a block that just became full under its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # An identical block computed concurrently keeps the index entry; this one stays private.
        self._cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
