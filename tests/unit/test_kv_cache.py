"""KV-cache bookkeeping without a model: block hashes, reference counts, the free queue's
eviction order, and what a block hash covers."""

from __future__ import annotations

from core.kv_cache import ImageSpan, KVCacheManager, hash_block

SALT_A, SALT_B = b"a" * 32, b"b" * 32


def _hashes(tokens: list[int], salt: bytes, spans: tuple[ImageSpan, ...] = ()) -> list[bytes]:
    out, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % 4, 4):
        parent = hash_block(parent, tokens[i : i + 4], spans, i, salt)
        out.append(parent)
    return out


def test_block_hash_covers_tokens_chain_images_and_tenant() -> None:
    base = hash_block(b"", [1, 2, 3, 4], (), 0, SALT_A)
    assert base == hash_block(b"", [1, 2, 3, 4], (), 0, SALT_A)
    assert base != hash_block(b"", [1, 2, 3, 5], (), 0, SALT_A)
    assert base != hash_block(b"p", [1, 2, 3, 4], (), 0, SALT_A)
    assert base != hash_block(b"", [1, 2, 3, 4], (), 0, SALT_B)
    img = (ImageSpan(2, 10, b"image-1"),)
    other = (ImageSpan(2, 10, b"image-2"),)
    assert hash_block(b"", [1, 2, 9, 9], img, 0, SALT_A) != hash_block(
        b"", [1, 2, 9, 9], other, 0, SALT_A
    )
    far = (ImageSpan(8, 10, b"image-2"),)  # outside the block: does not change its hash
    assert hash_block(b"", [1, 2, 3, 4], far, 0, SALT_A) == base


def test_shared_prefix_is_reference_counted_and_survives_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    tokens = list(range(12))
    hashes = _hashes(tokens, SALT_A)
    kv.allocate(1, 12, [])
    kv.register_full_blocks(1, hashes)
    prefix = kv.cached_prefix(hashes, 2)
    assert [b.block_id for b in prefix] == [b.block_id for b in kv.tables[1][:2]]
    assert kv.can_allocate(2, 12, prefix) and kv.blocks_needed(2, 12, prefix) == 1
    kv.allocate(2, 12, prefix)
    assert [b.ref_count for b in kv.tables[2]] == [2, 2, 1]
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 6  # all free, but the hashed ones are still findable
    assert len(kv.cached_prefix(hashes, 3)) == 3
    assert kv.cached_prefix(_hashes(tokens, SALT_B), 3) == []  # another tenant: nothing
    kv.allocate(3, 12, [])  # takes the 3 unhashed blocks first
    assert len(kv.cached_prefix(hashes, 3)) == 3 and kv.pool.num_evictions == 0
    kv.allocate(4, 4, [])  # now one cached block must go: the least recently freed (tail)
    assert kv.pool.num_evictions == 1
    assert len(kv.cached_prefix(hashes, 3)) == 2


def test_prefix_caching_off_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    hashes = _hashes(list(range(8)), SALT_A)
    kv.allocate(1, 8, [])
    kv.register_full_blocks(1, hashes)
    assert kv.cached_prefix(hashes, 2) == []
