"""Content hashes and feature-cache keys (DESIGN.md "Feature cache")."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def content_hash(data: bytes) -> str:
    """Hex SHA-256 of an item's raw bytes: the same bytes under any name hash alike."""
    return hashlib.sha256(data).hexdigest()


def key_sha256(key: str) -> str:
    """How API keys are stored in config: hex SHA-256 of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class FeatureKey:
    """Everything that decides an item's encoder output, scoped to one tenant."""

    tenant: str  # the tenant that owns the entry
    content_hash: str  # SHA-256 of the item's bytes
    encoder_id: str  # encoder name
    encoder_digest: str  # digest of the encoder weights
    preprocess_version: str  # the gateway's steps and the core's rule digest (shared.preprocess)
    resolution: int  # tile / view side, or a native token's side, in pixels
    tile_rows: int  # tile grid, crop grid or native size in tokens: rows
    tile_cols: int  # ... and cols
    frame: int = 0  # frame index within an animation or video
    shape: tuple[int, ...] = ()  # the item's tensor shape (a native item's frame count is here)
    frame_interval_s: float = 0.0  # a video's sampling interval; 0 = a still image

    def encode(self) -> bytes:
        fields: tuple[str, ...] = (
            self.tenant,
            self.content_hash,
            self.encoder_id,
            self.encoder_digest,
            self.preprocess_version,
            str(self.resolution),
            f"{self.tile_rows}x{self.tile_cols}",
            str(self.frame),
            "x".join(map(str, self.shape)),
        )
        # Another sampling rate picks other frames (and other rope positions for prefix reuse);
        # a still image's key stays as it was, so stored entries survive this field.
        if self.frame_interval_s:
            fields += (repr(self.frame_interval_s),)
        return "\x1f".join(fields).encode()
