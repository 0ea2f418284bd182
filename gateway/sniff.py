"""Format detection from magic bytes against the allow-list; names and MIME types are ignored."""

from __future__ import annotations

from shared.errors import Reason, VisorError

# Pillow format names, used as `formats=` so that Pillow tries no other decoder.
ALLOWED = ("JPEG", "PNG", "WEBP", "GIF")
# Containers decoded by PyAV (gateway.video) when `[gateway] video` is on.
VIDEO = ("MP4", "WEBM")
# ISO-BMFF major brands of MP4/QuickTime video. HEIF/AVIF stills (heic, mif1, avif, ...) share the
# box format but are not on the list: they are not video, and the MP4 demuxer is the wrong parser.
MP4_BRANDS = frozenset(
    {
        b"isom",
        b"iso2",
        b"iso4",
        b"iso5",
        b"iso6",
        b"mp41",
        b"mp42",
        b"avc1",
        b"av01",
        b"dash",
        b"M4V ",
        b"qt  ",
    }
)
EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska / WebM


def sniff(data: bytes, video: bool = True) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if video and data[4:8] == b"ftyp" and data[8:12] in MP4_BRANDS:
        return "MP4"
    if video and data[:4] == EBML_MAGIC:
        return "WEBM"
    allowed = "JPEG, PNG/APNG, WebP, GIF" + (", MP4, WebM" if video else "")
    raise VisorError(Reason.UNSUPPORTED_FORMAT, f"media format is not allowed; allowed: {allowed}")
