"""Format detection from magic bytes against the allow-list; names and MIME types are ignored."""

from __future__ import annotations

from shared.errors import Reason, VisorError

# Pillow format names, used as `formats=` so that Pillow tries no other decoder.
ALLOWED = ("JPEG", "PNG", "WEBP", "GIF")


def sniff(data: bytes) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    raise VisorError(
        Reason.UNSUPPORTED_FORMAT, "media format is not allowed; allowed: JPEG, PNG/APNG, WebP, GIF"
    )
