"""The tenant-scoped feature cache in LMDB (DESIGN.md "Feature cache").

Key: a 16-byte tenant prefix (so one tenant's entries are one key range) + SHA-256 of the full
`FeatureKey` (tenant, content hash, encoder id and digest, preprocessing version, resolution,
tile grid, frame). Value: a versioned header, the projected visual tokens, their importance
scores, and an integrity check: xxh3-64 over key + header + payload, or, when encryption at rest
is on, AES-GCM with a per-tenant key derived from the master key and the key + header as
associated data. A value that fails its check, or has expired, reads as a miss and is deleted.

Bounded: least-recently-used entries are evicted before a write would pass `max_bytes` (the
LMDB map is sized well above it, so a request never meets MapFullError) or a tenant's quota.
Access times are kept in memory and written with the next write, so a hit costs one read
transaction. Several processes may share one directory: LMDB serialises writers across them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from core.config import CacheConfig
from shared.hashing import FeatureKey

# 2: a Qwen entry's importance is the attention its tokens receive (was their feature norm),
# which its profiles now rank by; older entries read as misses.
MAGIC, VERSION = b"VSRF", 2
_HEADER = struct.Struct("<4sHBBddII")  # magic, version, dtype, flags, created, expires, n, hidden
_META = struct.Struct("<dQ")  # last access, stored bytes
_COUNT = struct.Struct("<Q")
_DTYPES: dict[int, np.dtype[np.floating]] = {1: np.dtype(np.float32), 2: np.dtype(np.float16)}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
_ENCRYPTED = 1
_FLUSH_TOUCHES = 256
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    features: np.ndarray  # (tokens, hidden) projected visual tokens, read-only
    importance: np.ndarray  # (tokens,) float32 scores for pruning, read-only


@dataclass(frozen=True, slots=True)
class Stats:
    entries: int  # entries stored
    bytes: int  # bytes stored (keys + values)
    max_bytes: int  # the bound
    tenants: dict[str, int]  # bytes per tenant prefix (hex), never tenant names
    hits: int  # this process
    misses: int  # this process
    evictions: int  # this process
    rejected: int  # corrupt or expired values deleted, this process


def tune_malloc() -> None:
    """Keeps multi-MiB buffers on glibc's heap instead of fresh mmaps: a cached entry of a few
    MiB is then copied out of LMDB in well under a millisecond instead of several (page faults)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 256 * MIB)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 512 * MIB)  # M_TRIM_THRESHOLD


class CacheUnavailable(Exception):
    """The cache cannot be opened or created; `reason` is a short code, safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # truncated | corrupt | unwritable | io_error


def _open_env(path: Path, map_size: int) -> lmdb.Environment:
    """Opens (or creates) the LMDB environment and checks, before anything reads a data page,
    that the data file holds every page its meta page names: LMDB reads pages through mmap, so
    a page past the end of a truncated file would kill the process with SIGBUS."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        env = lmdb.open(str(path), map_size=map_size, max_dbs=3, readahead=False, metasync=False)
    except (PermissionError, NotADirectoryError, FileExistsError, lmdb.ReadonlyError):
        raise CacheUnavailable("unwritable") from None
    except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError):
        raise CacheUnavailable("corrupt") from None
    except (OSError, lmdb.Error):
        raise CacheUnavailable("io_error") from None
    # info() and stat() read only the two meta pages, which mdb_env_open found in the file.
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    try:
        size = (path / "data.mdb").stat().st_size
    except OSError:
        size = -1
    if size < needed:
        env.close()
        raise CacheUnavailable("truncated")
    return env


def tenant_prefix(tenant: str) -> bytes:
    return hashlib.sha256(b"visor-tenant\0" + tenant.encode()).digest()[:16]


class FeatureCache:
    def __init__(
        self,
        path: Path,
        max_bytes: int,
        ttl_s: float,
        tenant_max_bytes: int = 0,
        no_cache_tenants: Iterable[str] = (),
        master_key: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.tenant_max_bytes = tenant_max_bytes or max_bytes
        self.no_cache = frozenset(no_cache_tenants)
        self._master, self._clock = master_key, clock
        # Sparse file: the map costs disk only as it fills; the headroom absorbs LMDB's page
        # overhead so eviction, not MapFullError, is what bounds the cache.
        self.env = _open_env(path, 2 * max_bytes + 64 * MIB)
        try:
            self._entries = self.env.open_db(b"entries")
            self._meta = self.env.open_db(b"meta")
            self._tenants = self.env.open_db(b"tenants")
        except lmdb.Error:
            self.env.close()
            raise CacheUnavailable("corrupt") from None
        self._touched: dict[bytes, float] = {}
        self._hits = self._misses = self._evictions = self._rejected = 0

    @classmethod
    def from_config(cls, cfg: CacheConfig) -> FeatureCache:
        """The cache a core (or `visor cache`) opens for its [cache] section."""
        return cls(
            Path(cfg.path).expanduser(),
            cfg.max_bytes,
            cfg.ttl_s,
            cfg.tenant_max_bytes,
            cfg.no_cache_tenants,
            cfg.master_key(),
        )

    def enabled_for(self, tenant: str) -> bool:
        return tenant not in self.no_cache

    @staticmethod
    def db_key(key: FeatureKey) -> bytes:
        return tenant_prefix(key.tenant) + hashlib.sha256(key.encode()).digest()

    def ttl_for(self, ttl_s: float) -> float:
        """A tenant's TTL (0 = none of its own) never outlives the cache's."""
        return min(ttl_s, self.ttl_s) if ttl_s > 0 else self.ttl_s

    def get(self, key: FeatureKey, ttl_s: float = 0.0) -> Entry | None:
        """The entry, unless missing, damaged, or older than `ttl_for(ttl_s)`: a tenant whose
        TTL was shortened after its entries were written misses them from then on."""
        if not self.enabled_for(key.tenant):
            return None
        k = self.db_key(key)
        with self.env.begin(db=self._entries) as txn:
            value = txn.get(k)
        max_age = self.ttl_for(ttl_s)
        entry = None if value is None else self._decode(k, key.tenant, value, max_age)
        if entry is None:
            self._misses += 1
            if value is not None:
                self._rejected += 1
                self._delete(k)
            return None
        self._hits += 1
        self._touched[k] = self._clock()
        if len(self._touched) >= _FLUSH_TOUCHES:
            self.flush()
        return entry

    def put(self, key: FeatureKey, entry: Entry, ttl_s: float = 0.0) -> bool:
        """Stores an entry that expires after `ttl_for(ttl_s)`; False when it is not cached
        (tenant opted out, or too big)."""
        if not self.enabled_for(key.tenant):
            return False
        k = self.db_key(key)
        value = self._encode(k, key.tenant, entry, self.ttl_for(ttl_s))
        size = len(k) + len(value)
        if size > self.tenant_max_bytes or size > self.max_bytes // 4:
            return False
        for attempt in range(2):
            try:
                with self.env.begin(write=True) as txn:
                    self._write_touches(txn)
                    self._make_room(txn, tenant_prefix(key.tenant), size, strict=attempt == 1)
                    self._store(txn, k, value)
                return True
            except lmdb.MapFullError:
                continue  # the retry evicts down to half the bound first
        return False

    def _store(self, txn: lmdb.Transaction, k: bytes, value: bytes) -> None:
        old = txn.get(k, db=self._meta)
        if old is not None:
            self._forget(txn, k, _META.unpack(old)[1])
        txn.put(k, value, db=self._entries)
        size = len(k) + len(value)
        txn.put(k, _META.pack(self._clock(), size), db=self._meta)
        self._add(txn, k[:16], size)

    def _make_room(self, txn: lmdb.Transaction, prefix: bytes, size: int, strict: bool) -> None:
        tenant_bytes = self._count(txn, prefix)
        if tenant_bytes + size > self.tenant_max_bytes:
            self._evict(txn, tenant_bytes + size - self.tenant_max_bytes, prefix)
        total = sum(_COUNT.unpack(v)[0] for _, v in txn.cursor(db=self._tenants))
        limit = self.max_bytes // 2 if strict else self.max_bytes
        if total + size > limit:
            # Evict a little more than needed, so the next writes do not each scan again.
            self._evict(txn, total + size - int(limit * 0.9))

    def _evict(self, txn: lmdb.Transaction, need: int, prefix: bytes | None = None) -> None:
        rows: list[tuple[tuple[float, int], bytes]] = []
        cursor = txn.cursor(db=self._meta)
        found = cursor.set_range(prefix) if prefix else cursor.first()
        while found:
            k, v = bytes(cursor.key()), bytes(cursor.value())
            if prefix and not k.startswith(prefix):
                break
            rows.append((_META.unpack(v), k))
            found = cursor.next()
        rows.sort()
        freed = 0
        for (_, size), k in rows:
            if freed >= need:
                break
            self._forget(txn, k, size)
            txn.delete(k, db=self._entries)
            freed += size
            self._evictions += 1

    def _forget(self, txn: lmdb.Transaction, k: bytes, size: int) -> None:
        txn.delete(k, db=self._meta)
        self._add(txn, k[:16], -size)

    def _count(self, txn: lmdb.Transaction, prefix: bytes) -> int:
        raw = txn.get(prefix, db=self._tenants)
        return 0 if raw is None else int(_COUNT.unpack(raw)[0])

    def _add(self, txn: lmdb.Transaction, prefix: bytes, delta: int) -> None:
        total = max(0, self._count(txn, prefix) + delta)
        if total:
            txn.put(prefix, _COUNT.pack(total), db=self._tenants)
        else:
            txn.delete(prefix, db=self._tenants)

    def _write_touches(self, txn: lmdb.Transaction) -> None:
        touched, self._touched = self._touched, {}
        for k, at in touched.items():
            raw = txn.get(k, db=self._meta)
            if raw is not None:
                txn.put(k, _META.pack(at, _META.unpack(raw)[1]), db=self._meta)

    def flush(self) -> None:
        """Writes the access times collected since the last write."""
        if self._touched:
            with self.env.begin(write=True) as txn:
                self._write_touches(txn)

    def _delete(self, k: bytes) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(k, db=self._meta)
            txn.delete(k, db=self._entries)
            if raw is not None:
                self._forget(txn, k, _META.unpack(raw)[1])

    def purge(self, tenant: str) -> int:
        """Deletes every entry of one tenant; returns how many."""
        prefix = tenant_prefix(tenant)
        removed = 0
        with self.env.begin(write=True) as txn:
            cursor = txn.cursor(db=self._meta)
            found = cursor.set_range(prefix)
            keys = []
            while found and cursor.key().startswith(prefix):
                keys.append(cursor.key())
                found = cursor.next()
            for k in keys:
                txn.delete(k, db=self._meta)
                txn.delete(k, db=self._entries)
                removed += 1
            txn.delete(prefix, db=self._tenants)
        return removed

    def stats(self) -> Stats:
        with self.env.begin() as txn:
            entries = txn.stat(self._entries)["entries"]
            tenants = {k.hex(): _COUNT.unpack(v)[0] for k, v in txn.cursor(db=self._tenants)}
        return Stats(
            entries,
            sum(tenants.values()),
            self.max_bytes,
            tenants,
            self._hits,
            self._misses,
            self._evictions,
            self._rejected,
        )

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.env.close()

    # -- values -------------------------------------------------------------------------------

    def _cipher(self, tenant: str) -> AESGCM:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        assert self._master is not None
        info = b"visor-feature-cache\0" + tenant.encode()
        derived = HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(self._master)
        return AESGCM(derived)

    def _encode(self, k: bytes, tenant: str, entry: Entry, ttl_s: float) -> bytes:
        feats = np.ascontiguousarray(entry.features)
        scores = np.ascontiguousarray(entry.importance, dtype=np.float32)
        n, hidden = feats.shape
        now = self._clock()
        flags = _ENCRYPTED if self._master else 0
        header = _HEADER.pack(
            MAGIC, VERSION, _DTYPE_CODES[feats.dtype], flags, now, now + ttl_s, n, hidden
        )
        payload = feats.tobytes() + scores.tobytes()
        if self._master:
            nonce = os.urandom(12)
            sealed = self._cipher(tenant).encrypt(nonce, payload, k + header)
            return header + nonce + sealed
        return bytes(header + payload + xxhash.xxh3_64_digest(k + header + payload))

    def _decode(self, k: bytes, tenant: str, value: bytes, max_age: float) -> Entry | None:
        if len(value) < _HEADER.size:
            return None
        magic, version, dtype_code, flags, created, expires, n, hidden = _HEADER.unpack_from(value)
        dtype = _DTYPES.get(dtype_code)
        now = self._clock()
        if magic != MAGIC or version != VERSION or dtype is None:
            return None
        if expires < now or created + max_age < now:
            return None
        header, body = value[: _HEADER.size], memoryview(value)[_HEADER.size :]
        payload: bytes | memoryview
        if flags & _ENCRYPTED:
            if self._master is None:
                return None
            try:
                payload = self._cipher(tenant).decrypt(
                    bytes(body[:12]), bytes(body[12:]), k + header
                )
            except Exception:
                return None
        else:
            payload, check = body[:-8], body[-8:]
            digest = xxhash.xxh3_64()
            for part in (k, header, payload):
                digest.update(part)
            if digest.digest() != check:
                return None
        feat_bytes = n * hidden * dtype.itemsize
        if len(payload) != feat_bytes + n * 4:
            return None
        feats = np.frombuffer(payload, dtype=dtype, count=n * hidden).reshape(n, hidden)
        scores = np.frombuffer(payload, dtype=np.float32, offset=feat_bytes, count=n)
        return Entry(feats, scores)
