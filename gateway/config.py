"""The gateway's `[gateway]` and `[limits]` sections (`[[tenants]]`: gateway.tenants)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ConfigError
from shared.net import is_loopback, split_host_port
from shared.tls import TlsFiles
from shared.wire import PROFILES

MIB = 1024 * 1024
SANDBOX_MODES = ("strict", "best-effort")
DNS_SCHEME = "dns:///"  # a `cores` entry naming a DNS name that resolves to many cores


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    listen: str = "127.0.0.1:50051"  # public gRPC address; loopback by default
    # Cores to route to: "host:port" (one core each) or "dns:///name:port" (every address the
    # name resolves to, re-resolved every dns_refresh_s), in any mix.
    cores: tuple[str, ...] = ("127.0.0.1:50052",)
    health_interval_s: float = 1.0  # grpc.health.v1 check of each core this often
    health_timeout_s: float = 1.0  # a check slower than this marks the core down
    dns_refresh_s: float = 30.0  # how often dns:/// entries are resolved again
    core_tls_ca: str = ""  # PEM CA that signed the cores' certificates; with cert + key: mTLS
    core_tls_cert: str = ""  # PEM client certificate the gateway presents to cores
    core_tls_key: str = ""  # PEM private key of core_tls_cert
    core_tls_server_name: str = ""  # name checked in the core's certificate; "" = host dialled
    metrics_listen: str = "127.0.0.1:9101"  # Prometheus endpoint; empty disables it
    decode_workers: int = 2  # sandboxed decode processes
    decode_timeout_s: float = 10.0  # decode time per request, all jobs; then the worker is killed
    worker_max_jobs: int = 200  # a worker is replaced after this many jobs
    grace_s: float = 5.0  # how long shutdown waits for requests in flight
    default_profile: str = "none"  # compression profile when a request names none
    sandbox: str = "best-effort"  # "strict" refuses to start unless every protection is active
    worker_memory_mb: int = 2048  # RLIMIT_AS per decode worker (its whole address space)
    worker_shm_mb: int = 32  # shared-memory pixel buffer per worker (decoded tiles of one job)
    max_decode_queue: int = 64  # decode jobs waiting for a worker before OVERLOADED
    max_concurrent_streams: int = 256  # HTTP/2 streams per client connection
    max_connection_idle_s: float = 300.0  # an idle client connection is closed after this
    keepalive_min_interval_s: float = 30.0  # pings more often than this are a policy violation
    default_deadline_s: float = 120.0  # applied when the client sends no deadline
    max_concurrent_per_tenant: int = 0  # requests in flight per tenant; 0 = no cap
    rate_per_tenant: float = 0.0  # requests per second per tenant (token bucket); 0 = no cap
    burst_per_tenant: int = 0  # token-bucket size; 0 = max(1, rate_per_tenant)
    video: bool = True  # MP4/WebM (H.264, VP9, AV1) accepted; false: UNSUPPORTED_FORMAT
    max_requests_in_flight: int = 512  # Generate calls admitted at once, all tenants; OVERLOADED
    upload_idle_timeout_s: float = 10.0  # an upload whose next message takes longer is ended
    max_upload_bytes_in_flight: int = 256 * MIB  # bytes held by unfinished uploads; OVERLOADED
    core_attempt_timeout_s: float = 2.0  # one core's Describe and cache reply; slower = down
    core_hedge_after_s: float = 0.2  # most a handshake waits before the next core is asked too

    def validate(self) -> None:
        split_host_port(self.listen)
        self._validate_cores()
        if self.decode_workers < 1 or self.worker_max_jobs < 1 or self.decode_timeout_s <= 0:
            raise ConfigError("[gateway] decode_workers, worker_max_jobs, decode_timeout_s > 0")
        if self.default_profile not in PROFILES:
            raise ConfigError(f"[gateway] default_profile must be one of {', '.join(PROFILES)}")
        if self.sandbox not in SANDBOX_MODES:
            raise ConfigError(f"[gateway] sandbox must be one of {', '.join(SANDBOX_MODES)}")
        positive = (
            self.worker_memory_mb,
            self.worker_shm_mb,
            self.max_decode_queue,
            self.max_concurrent_streams,
            self.max_connection_idle_s,
            self.keepalive_min_interval_s,
            self.default_deadline_s,
        )
        if min(positive) <= 0:
            raise ConfigError(
                "[gateway] worker_memory_mb, worker_shm_mb, max_decode_queue, "
                "max_concurrent_streams and the keepalive/idle/deadline seconds must be > 0"
            )
        if min(self.max_concurrent_per_tenant, self.rate_per_tenant, self.burst_per_tenant) < 0:
            raise ConfigError("[gateway] per-tenant quotas must be >= 0 (0 = no cap)")
        if min(self.health_interval_s, self.health_timeout_s, self.dns_refresh_s) <= 0:
            raise ConfigError("[gateway] health_interval_s, health_timeout_s, dns_refresh_s > 0")
        admission = (
            self.max_requests_in_flight,
            self.upload_idle_timeout_s,
            self.max_upload_bytes_in_flight,
            self.core_attempt_timeout_s,
            self.core_hedge_after_s,
        )
        if min(admission) <= 0:
            raise ConfigError(
                "[gateway] max_requests_in_flight, upload_idle_timeout_s, "
                "max_upload_bytes_in_flight, core_attempt_timeout_s and core_hedge_after_s "
                "must be > 0"
            )

    def _validate_cores(self) -> None:
        if not self.cores:
            raise ConfigError("[gateway] cores must name at least one core")
        self.core_tls().check("[gateway] core_tls_ca, core_tls_cert, core_tls_key")
        for core in self.cores:
            address = core.removeprefix(DNS_SCHEME)
            split_host_port(address)
            if not self.core_tls().enabled and not is_loopback(address):
                raise ConfigError(
                    f"[gateway] core {core!r} is not loopback: plaintext is allowed only on "
                    "loopback; set core_tls_ca, core_tls_cert and core_tls_key"
                )

    def core_tls(self) -> TlsFiles:
        return TlsFiles(self.core_tls_ca, self.core_tls_cert, self.core_tls_key)


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_items: int = 8  # media items per request
    max_item_bytes: int = 20 * MIB  # encoded bytes per item
    max_request_bytes: int = 48 * MIB  # encoded bytes per request, all items
    max_prompt_bytes: int = 16 * 1024  # UTF-8 bytes of all text in the request
    max_new_tokens: int = 512  # cap on GenerationParams.max_new_tokens
    max_stop_strings: int = 8  # stop strings per request
    max_stop_bytes: int = 64  # UTF-8 bytes per stop string
    default_new_tokens: int = 128  # when a request asks for 0
    max_pixels: int = 7680 * 4320  # pixels per frame, read from the header
    max_side: int = 16384  # width or height, read from the header
    max_frames: int = 64  # declared frames of an animation
    max_sampled_frames: int = 8  # frames sampled uniformly from an animation, one item each
    max_tiles: int = 6  # grid cells for detail=high (plus one thumbnail tile)
    max_video_duration_s: float = 60.0  # declared duration of a video
    max_video_streams: int = 4  # streams of any kind in a video container
    max_video_frames: int = 3600  # declared, then decoded, frames of a video stream
    video_sample_fps: float = 1.0  # video frames sampled per second, up to max_sampled_frames

    def validate(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) <= 0:  # integers >= 1; seconds and rates > 0
                raise ConfigError(f"[limits] {name} must be > 0")
        if self.default_new_tokens > self.max_new_tokens:
            raise ConfigError("[limits] default_new_tokens must not exceed max_new_tokens")
        if self.max_item_bytes > self.max_request_bytes:
            raise ConfigError("[limits] max_item_bytes must not exceed max_request_bytes")
