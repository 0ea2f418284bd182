"""structlog JSON logging with one allow-list redaction processor.

Only allow-listed keys pass; text fields (prompt, output) become a length and a hash; tenant ids
become an HMAC-SHA256 under the deployment's log key (`shared.secret`), so gateway and core lines
of one tenant correlate while a guessed name cannot be tested without the secret; anything else
is dropped and its key listed under `redacted`. Media bytes, base64, credentials and EXIF
therefore never reach a log line, whatever a caller passes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

# Keys whose values are ours (numbers, enums, ids we minted) and safe to print as they are.
ALLOWED_KEYS = frozenset(
    {
        "event",
        "level",
        "timestamp",
        "logger",
        "service",
        "request_id",
        "core_id",
        "reason",
        "status",
        "code",
        "timings_ms",
        "num_items",
        "num_bytes",
        "num_tiles",
        "text_tokens",
        "visual_tokens_before",
        "visual_tokens_after",
        "output_tokens",
        "cache",
        "listen",
        "model",
        "backend",
        "cores",
        "core",
        "workers",
        "finish_reason",
        "content_hash",
        "protections",
        "error_type",
        "grace_s",
        "version",
        "pid",
        "port",
        "duration_ms",
        "format",
        "width",
        "height",
        "frames",
        "dtype",
        "device",
        "shape",
        "detail",
        "profile",
        "where",
        "mtls",
        "address",
        "healthy",
        "num_cores",
        "attempt",
        "config_error",
        "num_tenants",
        "sections",
    }
)
# Keys whose values are user text: logged as length + short hash only.
TEXT_KEYS = frozenset({"prompt", "text", "output", "stop"})
# Keys whose values identify a party: logged hashed.
HASHED_KEYS = frozenset({"tenant"})
_MAX_STR = 200


# Random per process until configure() is given the deployment's key: hashes then correlate
# within one process only, and are never an unsalted (guessable) digest.
_tenant_key = secrets.token_bytes(32)


def short_hash(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:16]


def tenant_hash(tenant: str) -> str:
    """The keyed hash a tenant id is logged as."""
    return hmac.new(_tenant_key, tenant.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:16]


def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """The redaction processor (allow-list based)."""
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in event.items():
        if key in TEXT_KEYS:
            text = value if isinstance(value, str) else repr(value)
            out[f"{key}_len"] = len(text)
            out[f"{key}_sha256"] = short_hash(text)
        elif key in HASHED_KEYS:
            out[f"{key}_hash"] = tenant_hash(str(value))
        elif key in ALLOWED_KEYS:
            out[key] = _safe(value)
        else:
            dropped.append(key)
    if dropped:
        out["redacted"] = sorted(dropped)
    return out


def _safe(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, str):
        clipped = value[:_MAX_STR]
        return clipped.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    if isinstance(value, Mapping):
        return {str(k)[:_MAX_STR]: _safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe(v) for v in value[:64]]
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return f"<{type(value).__name__}>"


def error_site(exc: BaseException) -> str:
    """`file:line` of the innermost frame: enough to find a bug, without the message (which may
    quote user content)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    return f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}"


def configure(service: str, level: str = "info", log_key: bytes | None = None) -> None:
    """JSON lines on stderr, redacted, for the named service; `log_key` (from the deployment
    secret) keys the tenant hashes."""
    global _tenant_key
    if log_key is not None:
        _tenant_key = log_key
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get(name: str) -> Any:
    return structlog.get_logger(name)
