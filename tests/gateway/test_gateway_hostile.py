"""Generated hostile inputs through the running gateway (no corpus needed): each gets its clean
status + reason, nothing hangs, and afterwards the gateway still serves with its worker count
intact and no zombie left."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import CORPUS, OTHER_KEY, Stack, corpus_rows, need_corpus
from tests.gateway import hostile
from tests.helpers import generate, request

DECODE_TIMEOUT_S = 10.0  # the gateway default the stack runs with

CASES = [
    ("jpeg-64250x64250", lambda: hostile.jpeg_declaring(64250, 64250), "PIXEL_LIMIT"),
    ("png-100000x100000", lambda: hostile.png_declaring(100_000, 100_000), "PIXEL_LIMIT"),
    ("gif-10000-frames", lambda: hostile.gif_with_frames(10_000), "FRAME_LIMIT"),
    ("png-ztxt-bomb", hostile.png_text_bomb, "CORRUPT_MEDIA"),
    ("png-truncated", hostile.truncated_png, "CORRUPT_MEDIA"),
    ("empty-file", lambda: b"", "UNSUPPORTED_FORMAT"),
    ("jpeg-with-zip", hostile.jpeg_with_zip, ""),  # served: bytes after EOI are never read
    ("gif-3-frames", lambda: hostile.gif_with_frames(3), ""),
    # The corpus's other classes, generated: canvas and frame-extent bombs, broken PNG streams,
    # animations over the frame limit in every animated format, formats off the allow-list.
    ("gif-declaring-65535x65535", lambda: hostile.gif_declaring(65535, 65535), "PIXEL_LIMIT"),
    ("gif-frame-outside-canvas", hostile.gif_frame_outside_canvas, "PIXEL_LIMIT"),
    ("png-broken-zlib", hostile.png_broken_zlib, "CORRUPT_MEDIA"),
    ("png-chunk-past-the-file", hostile.png_chunk_past_the_file, "CORRUPT_MEDIA"),
    ("apng-100-frames", lambda: hostile.animated("PNG", 100), "FRAME_LIMIT"),
    ("webp-100-frames", lambda: hostile.animated("WEBP", 100), "FRAME_LIMIT"),
    ("gif-100-frames", lambda: hostile.animated("GIF", 100), "FRAME_LIMIT"),
    ("webp-animated-5", lambda: hostile.animated("WEBP", 5), ""),
    ("tiff", lambda: hostile.other_format("TIFF"), "UNSUPPORTED_FORMAT"),
    ("ico", lambda: hostile.other_format("ICO"), "UNSUPPORTED_FORMAT"),
]


@pytest.mark.parametrize(("name", "make", "reason"), CASES, ids=[c[0] for c in CASES])
def test_hostile_input_gets_its_outcome(stack: Stack, name: str, make: object, reason: str) -> None:
    out = generate(stack.gateway, request(media=(make(),)), timeout=30)  # type: ignore[operator]
    if reason:
        assert out.code != grpc.StatusCode.OK, name
        assert out.reason == reason, (name, out.code, out.reason, out.message)
    else:
        assert out.code == grpc.StatusCode.OK, (name, out.code, out.reason, out.message)


def test_progressive_jpeg_with_hundreds_of_scans_never_sticks(stack: Stack) -> None:
    data = hostile.progressive_with_scans(500)
    t0 = time.monotonic()
    out = generate(stack.gateway, request(media=(data,)), timeout=60)
    elapsed = time.monotonic() - t0
    ok = out.code == grpc.StatusCode.OK
    assert ok or out.reason in ("DECODE_TIMEOUT", "CORRUPT_MEDIA"), (out.code, out.reason)
    assert elapsed < DECODE_TIMEOUT_S + 20


def gateway_children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the decode workers under `pid` (multiprocessing's resource tracker, also
    a child, is not a worker)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if int(fields[1]) == pid and (b"spawn_main" in cmdline or fields[0] == "Z"):
            out.append((int(entry.name), fields[0]))
    return out


def assert_workers_steady(stack: Stack, workers: int = 2) -> None:
    """Exactly `workers` live decode processes under the gateway, none a zombie (replacements
    may still be starting for a moment after a kill, so this waits a little)."""
    deadline = time.monotonic() + 15
    while True:
        kids = gateway_children(stack.gateway_proc.pid)
        live = [k for k in kids if k[1] != "Z"]
        if len(live) == workers and len(kids) == workers:
            return
        assert time.monotonic() < deadline, kids
        time.sleep(0.2)


def test_after_the_whole_corpus_the_gateway_serves_and_no_worker_is_left_over(
    stack: Stack,
) -> None:
    need_corpus()
    for row in corpus_rows():
        # Tenant B: the feature cache is per tenant, so the request-path tests' first sight of
        # these files (as the dev tenant) stays a miss.
        media = ((CORPUS / row["file"]).read_bytes(),)
        out = generate(stack.gateway, request(media=media), key=OTHER_KEY)
        assert out.reason != "INTERNAL", row["file"]
    fresh = hostile.png(30, 40 + os.getpid() % 50)
    out = generate(stack.gateway, request(media=(fresh,)))
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
    assert_workers_steady(stack)


def test_after_hostile_inputs_the_gateway_serves_and_no_worker_is_left_over(
    stack: Stack,
) -> None:
    for _, make, _ in CASES:
        generate(stack.gateway, request(media=(make(),)), timeout=30)  # type: ignore[operator]
    # A fresh image: a sample here would be a cache hit for later tests that expect a decode.
    fresh = hostile.png(40 + os.getpid() % 50, 30)
    out = generate(stack.gateway, request(media=(fresh,)))
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
    assert_workers_steady(stack)
