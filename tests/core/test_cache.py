"""The LMDB feature cache, on a real LMDB in a temporary directory."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from core.cache import Entry, FeatureCache
from shared.hashing import FeatureKey

KEY = FeatureKey("tenant-a", "ab" * 32, "demo", "d" * 64, "pp1", 224, 1, 1, 0)


def entry(seed: int = 0, tokens: int = 196, hidden: int = 128) -> Entry:
    rng = np.random.default_rng(seed)
    return Entry(
        rng.standard_normal((tokens, hidden)).astype(np.float32),
        rng.random(tokens).astype(np.float32),
    )


def same(a: Entry | None, b: Entry) -> bool:
    return (
        a is not None
        and np.array_equal(a.features, b.features)
        and np.array_equal(a.importance, b.importance)
    )


def test_round_trip_and_key_completeness(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=60)
    e = entry()
    assert cache.put(KEY, e)
    assert same(cache.get(KEY), e)
    # The same bytes hash alike whatever the file was called: the key has no name in it.
    assert same(cache.get(dataclasses.replace(KEY)), e)
    changes = {
        "tenant": "tenant-b",
        "content_hash": "cd" * 32,
        "encoder_digest": "e" * 64,
        "encoder_id": "other",
        "preprocess_version": "pp2",
        "resolution": 336,
        "tile_rows": 2,
        "tile_cols": 2,
        "frame": 3,
    }
    for field, value in changes.items():
        assert cache.get(dataclasses.replace(KEY, **{field: value})) is None, field


def test_expired_entries_miss_and_are_deleted(tmp_path: Path) -> None:
    now = [1000.0]
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=10, clock=lambda: now[0])
    cache.put(KEY, entry())
    now[0] += 11
    assert cache.get(KEY) is None
    assert cache.stats().entries == 0 and cache.stats().rejected == 1


def test_eviction_keeps_under_the_bound_least_recently_used_first(tmp_path: Path) -> None:
    bound = 4 << 20
    clock = [0.0]

    def tick() -> float:
        clock[0] += 1
        return clock[0]

    cache = FeatureCache(tmp_path, bound, ttl_s=1e9, clock=tick)
    keys = [dataclasses.replace(KEY, content_hash=f"{i:064x}") for i in range(60)]
    for i, k in enumerate(keys):  # ~100 KiB each: six times the bound in all
        assert cache.put(k, entry(i))
        assert cache.get(keys[0]) is not None  # touched every round: never the LRU victim
        assert cache.stats().bytes <= bound
    stats = cache.stats()
    assert stats.evictions > 0
    assert cache.get(keys[0]) is not None  # recently used survives
    assert cache.get(keys[1]) is None  # cold and old: evicted
    assert cache.get(keys[-1]) is not None  # newest survives


def test_per_tenant_quota_evicts_only_that_tenant(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=60, tenant_max_bytes=1 << 20)
    other = dataclasses.replace(KEY, tenant="tenant-b")
    assert cache.put(other, entry())
    for i in range(30):
        assert cache.put(dataclasses.replace(KEY, content_hash=f"{i:064x}"), entry(i))
    tenants = cache.stats().tenants
    assert all(v <= 1 << 20 for v in tenants.values())
    assert cache.get(other) is not None


def test_corrupted_value_is_a_miss_and_deleted(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=60)
    cache.put(KEY, entry())
    k = cache.db_key(KEY)
    with cache.env.begin(write=True, db=cache._entries) as txn:
        value = bytearray(txn.get(k))
        value[100] ^= 0x01  # one flipped bit in the features
        txn.put(k, bytes(value))
    assert cache.get(KEY) is None
    with cache.env.begin(db=cache._entries) as txn:
        assert txn.get(k) is None
    with cache.env.begin(write=True, db=cache._entries) as txn:
        txn.put(k, b"garbage")
    assert cache.get(KEY) is None


def test_encryption_at_rest(tmp_path: Path) -> None:
    master = os.urandom(32)
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=60, master_key=master)
    e = entry()
    cache.put(KEY, e)
    with cache.env.begin(db=cache._entries) as txn:
        stored = txn.get(cache.db_key(KEY))
    assert e.features.tobytes()[:64] not in stored
    assert same(cache.get(KEY), e)
    cache.close()
    wrong = FeatureCache(tmp_path, 64 << 20, ttl_s=60, master_key=os.urandom(32))
    assert wrong.get(KEY) is None


def test_no_cache_tenants_purge_and_stats(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=60, no_cache_tenants=["private"])
    private = dataclasses.replace(KEY, tenant="private")
    assert not cache.put(private, entry()) and cache.get(private) is None
    other = dataclasses.replace(KEY, tenant="tenant-b")
    for i in range(3):
        cache.put(dataclasses.replace(KEY, content_hash=f"{i:064x}"), entry(i))
    cache.put(other, entry())
    assert cache.stats().entries == 4
    assert cache.purge("tenant-a") == 3
    assert cache.stats().entries == 1 and cache.get(other) is not None
    assert "tenant-a" not in str(cache.stats())  # stats name tenants only by hashed prefix


_WRITER = """
import sys, dataclasses
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.core.test_cache import KEY, entry
from core.cache import FeatureCache
cache = FeatureCache(Path({path!r}), 256 << 20, ttl_s=60)
print("ready", flush=True)
i = 0
while True:
    cache.put(dataclasses.replace(KEY, content_hash=f"{{i:064x}}"), entry(i, tokens=576))
    i += 1
    if i == {stop}:
        break
print("done", flush=True)
"""


def _writer(path: Path, stop: int) -> subprocess.Popen[str]:
    code = _WRITER.format(root=str(Path(__file__).resolve().parents[2]), path=str(path), stop=stop)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    writer = _writer(tmp_path, stop=5)
    assert writer.wait(60) == 0
    reader = FeatureCache(tmp_path, 256 << 20, ttl_s=60)
    for i in range(5):
        got = reader.get(dataclasses.replace(KEY, content_hash=f"{i:064x}"))
        assert same(got, entry(i, tokens=576))
    assert reader.put(dataclasses.replace(KEY, content_hash="f" * 64), entry(99))


def test_sigkill_mid_writes_leaves_whole_entries_or_none(tmp_path: Path) -> None:
    writer = _writer(tmp_path, stop=-1)  # writes until killed
    assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    cache = FeatureCache(tmp_path, 256 << 20, ttl_s=60)
    with cache.env.begin(db=cache._entries) as txn:
        stored = txn.stat(cache._entries)["entries"]
    assert stored > 0
    # The writer's size bound may have evicted its oldest entries, so scan past them.
    whole = 0
    for i in range(10 * stored + 1000):
        if whole == stored:
            break
        got = cache.get(dataclasses.replace(KEY, content_hash=f"{i:064x}"))
        if got is not None:
            assert same(got, entry(i, tokens=576))
            whole += 1
    assert whole >= stored - 1 and cache.stats().rejected == 0


def test_large_fp16_entry_round_trips(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, 256 << 20, ttl_s=60)
    rng = np.random.default_rng(0)
    big = Entry(
        rng.standard_normal((576, 4096)).astype(np.float16), rng.random(576).astype(np.float32)
    )
    assert cache.put(KEY, big)
    assert same(cache.get(KEY), big)


def truncated_cache(path: Path) -> None:
    """A cache of a few MiB whose data file then loses most of its pages, as a full disk or a
    crashed copy leaves it: LMDB's meta pages still name pages past the end of the file."""
    cache = FeatureCache(path, 64 << 20, ttl_s=60)
    for i in range(24):
        assert cache.put(dataclasses.replace(KEY, frame=i), entry(i))
    cache.close()
    data = path / "data.mdb"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 3)


def _open_in_child(path: Path) -> subprocess.CompletedProcess[str]:
    """Opens the cache in a child process: a SIGBUS there fails this test, not the test run."""
    code = (
        "import sys; from pathlib import Path; from core.cache import CacheUnavailable, "
        "FeatureCache\ntry:\n    FeatureCache(Path(sys.argv[1]), 64 << 20, 60).close()\n"
        "    print('opened')\nexcept CacheUnavailable as exc:\n    print(exc.reason)"
    )
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=root, capture_output=True, text=True
    )


def test_a_truncated_file_is_refused_before_any_page_is_read(tmp_path: Path) -> None:
    truncated_cache(tmp_path / "cache")
    out = _open_in_child(tmp_path / "cache")
    assert (out.returncode, out.stdout.strip()) == (0, "truncated"), out.stderr[-2000:]


def test_a_corrupt_file_and_an_unwritable_directory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "data.mdb").write_bytes(os.urandom(64 << 10))
    out = _open_in_child(tmp_path / "corrupt")
    assert (out.returncode, out.stdout.strip()) == (0, "corrupt"), out.stderr[-2000:]
    (tmp_path / "file").write_bytes(b"not a directory")
    out = _open_in_child(tmp_path / "file" / "cache")
    assert (out.returncode, out.stdout.strip()) == (0, "unwritable"), out.stderr[-2000:]
    healthy = tmp_path / "healthy"
    FeatureCache(healthy, 64 << 20, ttl_s=60).close()
    assert _open_in_child(healthy).stdout.strip() == "opened"
