"""KV-cache bookkeeping: a pool of fixed-size blocks, each sequence's block table, and the prefix
map (block hash -> block) with reference counts.

It holds no tensors (the model's `PagedKV` stores keys and values at the slots these blocks name).
A freed block that carries a hash stays findable until the pool needs it back: the free queue is
ordered for eviction, unhashed blocks first, then hashed ones least recently freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int  # index into the PagedKV storage
    ref_count: int = 0  # sequences whose table holds it
    block_hash: bytes | None = None  # set once the block is full and registered


# Stands in a block table for a block freed behind a sliding window: its keys are masked out, so
# any block's contents may be read there (block 0's); never in the pool.
NULL_BLOCK = Block(0, ref_count=-1)


@dataclass(frozen=True, slots=True)
class ImageSpan:
    start: int  # first prompt position of the image's tokens
    end: int  # one past the last
    content_key: bytes  # identifies the features that fill these positions


def hash_block(
    parent: bytes, token_ids: list[int], spans: tuple[ImageSpan, ...], start: int, salt: bytes
) -> bytes:
    """Hash of the block holding `token_ids` at positions start.. after the chain `parent`:
    also covers the content keys of the images whose tokens fall inside it, and the tenant salt."""
    digest = hashlib.sha256(parent)
    digest.update(salt)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    end = start + len(token_ids)
    for span in spans:
        if span.start < end and span.end > start:
            digest.update(span.content_key)
    return digest.digest()


class BlockPool:
    """The blocks, the free queue in eviction order, and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> Block | None:
        found = self._by_hash.get(block_hash)
        return None if found is None else self.blocks[found]

    def take(self) -> Block:
        """A free block for new content; evicts the least recently freed cached one if needed."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block

    def share(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def register(self, block: Block, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block.block_id


class KVCacheManager:
    """Block tables per sequence: `can_allocate` / `allocate` / `free`, prefix lookup, and
    registration of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[Block]] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix map
        self.num_hit_tokens = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def cached_prefix(self, hashes: list[bytes], max_blocks: int) -> list[Block]:
        """The longest run of leading blocks already in the map (at most `max_blocks`)."""
        found: list[Block] = []
        if not self.enable_prefix_caching:
            return found
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def blocks_needed(self, seq_id: int, num_tokens: int, prefix: list[Block]) -> int:
        """Blocks that holding `num_tokens` would take from the free queue."""
        held = len(self.tables.get(seq_id, ())) or len(prefix)
        reclaimed = sum(1 for b in prefix if b.ref_count == 0)
        return max(0, -(-num_tokens // self.block_size) - held) + reclaimed

    def can_allocate(self, seq_id: int, num_tokens: int, prefix: list[Block]) -> bool:
        return self.blocks_needed(seq_id, num_tokens, prefix) <= self.pool.num_free

    def allocate(self, seq_id: int, num_tokens: int, prefix: list[Block]) -> list[Block]:
        """Grows the table to hold `num_tokens`; a new sequence starts from `prefix`."""
        table = self.tables.get(seq_id)
        if table is None:
            for block in prefix:
                self.pool.share(block)
            table = self.tables[seq_id] = list(prefix)
        while len(table) * self.block_size < num_tokens:
            table.append(self.pool.take())
        return table

    def free(self, seq_id: int) -> None:
        """Returns the sequence's blocks; the last ones go first so a prefix outlives its tail."""
        for block in reversed(self.tables.pop(seq_id, [])):
            if block is not NULL_BLOCK:
                self.pool.release(block)

    def free_behind(self, seq_id: int, num_computed: int, window: int) -> int:
        """For a model whose every layer attends `window` keys back (itself included): returns
        the blocks no later query of the sequence can see (every index < num_computed - window
        + 1) to the pool, their table entries becoming `NULL_BLOCK` so that indices keep their
        places. A hashed block stays findable until the pool needs it. Returns how many."""
        table = self.tables[seq_id]
        dead = min(len(table), max(0, num_computed - window + 1) // self.block_size)
        freed = 0
        for i in range(dead):
            if table[i] is not NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
                freed += 1
        return freed

    def register_full_blocks(self, seq_id: int, hashes: list[bytes]) -> None:
        """Makes the sequence's first len(hashes) blocks findable by their hashes."""
        if not self.enable_prefix_caching:
            return
        for block, block_hash in zip(self.tables[seq_id], hashes, strict=False):
            if block is not NULL_BLOCK:
                self.pool.register(block, block_hash)

    def count_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens
