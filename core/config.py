"""The core's configuration sections: `[core]`, `[cache]` and `[scheduler]`."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from shared.config import ConfigError
from shared.net import is_loopback, split_host_port
from shared.tls import TlsFiles


@dataclass(frozen=True, slots=True)
class CoreConfig:
    listen: str = "127.0.0.1:50052"  # gRPC address; loopback by default
    model: str = "models/demo"  # llava-hf checkpoint directory
    core_id: str = ""  # reported as served_by; empty = "<hostname>:<port>"
    metrics_listen: str = "127.0.0.1:9102"  # Prometheus endpoint; empty disables it
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N; auto = the first CUDA device, else the CPU
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16; auto = bf16 on CUDA, float32 on CPU
    gpu_memory_fraction: float = 0.9  # CUDA: share of GPU memory for weights + KV cache
    encoder: str = "auto"  # auto | torch | onnxruntime | tensorrt
    artifacts_dir: str = "~/.cache/visor/artifacts"  # ONNX export and TensorRT engines
    encode_batch_tiles: int = 16  # vision queue: tiles per encoder batch
    encode_max_wait_ms: float = 2.0  # vision queue: how long a batch waits to fill
    grace_s: float = 5.0  # how long shutdown waits for requests in flight
    tls_cert: str = ""  # PEM server certificate (chain); with tls_key + tls_client_ca turns on mTLS
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA that signs gateway client certificates (client auth required)
    batch_invariant: bool = True  # logits bit for bit independent of batch-mates (slower decode)
    cuda_graphs: bool = True  # decode-only steps as CUDA graphs; only on CUDA, batch_invariant off
    compile: bool = False  # torch.compile decode-only steps (batch_invariant off); slow first steps

    def validate(self) -> None:
        split_host_port(self.listen)
        if self.num_threads < 0 or self.grace_s < 0 or self.encode_max_wait_ms < 0:
            raise ConfigError("[core] num_threads, grace_s and encode_max_wait_ms must be >= 0")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError("[core] gpu_memory_fraction must be in (0, 1]")
        if self.encode_batch_tiles < 1:
            raise ConfigError("[core] encode_batch_tiles must be >= 1")
        from core.device import resolve
        from core.encoders import BACKENDS

        if self.encoder == "torch-bf16":
            raise ConfigError(
                '[core] encoder "torch-bf16" is gone: set encoder = "torch" and dtype = "bfloat16"'
            )
        if self.encoder not in BACKENDS:
            raise ConfigError(f"[core] encoder must be one of {BACKENDS}")
        resolve(self.device, self.dtype)
        self.tls().check("[core] tls_client_ca, tls_cert, tls_key")
        if not self.tls().enabled and not is_loopback(self.listen):
            raise ConfigError(
                f"[core] listen = {self.listen!r} is not loopback: plaintext is allowed only on "
                "loopback; set tls_cert, tls_key and tls_client_ca (see `visor certs dev`)"
            )

    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_client_ca, self.tls_cert, self.tls_key)

    def resolved_core_id(self) -> str:
        return self.core_id or f"{os.uname().nodename}:{split_host_port(self.listen)[1]}"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    path: str = "~/.cache/visor/features"  # LMDB directory of the feature cache
    max_bytes: int = 2 << 30  # size bound; least-recently-used entries are evicted past it
    ttl_s: float = 7 * 24 * 3600.0  # an entry expires this long after it was written
    tenant_max_bytes: int = 0  # per-tenant quota; 0 = max_bytes
    no_cache_tenants: tuple[str, ...] = ()  # tenants whose features are never stored
    encrypt: bool = False  # AES-GCM at rest, one key per tenant derived from the master key
    master_key_file: str = ""  # 32 random bytes (raw or hex); required when encrypt is on
    enabled: bool = True  # false: every lookup misses, nothing is stored

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("[cache] path must not be empty")
        if self.max_bytes < 1 << 20 or self.ttl_s <= 0 or self.tenant_max_bytes < 0:
            raise ConfigError("[cache] max_bytes >= 1 MiB, ttl_s > 0, tenant_max_bytes >= 0")
        if self.encrypt and not self.master_key_file:
            raise ConfigError("[cache] encrypt needs master_key_file")

    def master_key(self) -> bytes | None:
        if not self.encrypt:
            return None
        raw = Path(self.master_key_file).expanduser().read_bytes().strip()
        key = bytes.fromhex(raw.decode()) if len(raw) == 64 else raw
        if len(key) != 32:
            raise ConfigError("[cache] master_key_file must hold 32 bytes (or 64 hex digits)")
        return key


class Policy(enum.Enum):
    """How the scheduler batches: `token-budget` is the one to deploy; the other two exist only
    to be measured against."""

    TOKEN_BUDGET = "token-budget"  # iteration-level batching under a per-step token budget
    REQUEST_COUNT = "request-count"  # fixed batches of `batch_size`, run to completion
    NONE = "none"  # one request at a time


SCHEDULER_POLICIES = tuple(p.value for p in Policy)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = "token-budget"  # token-budget | request-count | none
    max_batch_tokens: int = 2048  # per-step budget: prefill chunks + one per decoding sequence
    max_prefill_chunk: int = 512  # one sequence's prefill tokens per step (chunked prefill)
    decode_step_tokens: int = 32  # prefill tokens costing one decode step (0: prefills never yield)
    max_num_seqs: int = 32  # sequences running at once (token-budget)
    batch_size: int = 8  # requests per fixed batch (request-count)
    max_request_tokens: int = 8192  # visual + text + max_new_tokens of one request
    max_waiting: int = 256  # admitted, not yet running (encoding or queued); past it -> OVERLOADED
    max_items: int = 64  # media items per request (the gateway's max_items x max_sampled_frames)
    max_item_tiles: int = 16  # tiles per item, thumbnail included (the gateway sends max_tiles + 1)
    max_stop_strings: int = 16  # stop strings per request (the gateway's own cap is lower)
    max_stop_bytes: int = 256  # UTF-8 bytes per stop string
    max_format_bytes: int = 16 * 1024  # UTF-8 bytes of a response_format (schema, regex, grammar)
    grammar_cache_size: int = 128  # compiled response formats kept (LRU, shared by tenants)
    block_size: int = 16  # tokens per KV block; a multiple of 16
    kv_cache_mb: int = 1024  # memory of the paged KV cache
    chunked_prefill: bool = True  # spread long prefills over several steps
    prefix_caching: bool = True  # reuse KV blocks of identical prefixes (same tenant only)

    def validate(self) -> None:
        if self.policy not in SCHEDULER_POLICIES:
            raise ConfigError(f"[scheduler] policy must be one of {SCHEDULER_POLICIES}")
        if self.block_size < 16 or self.block_size % 16:
            raise ConfigError("[scheduler] block_size must be a positive multiple of 16")
        if min(self.max_batch_tokens, self.max_prefill_chunk) < 16:
            raise ConfigError("[scheduler] max_batch_tokens and max_prefill_chunk must be >= 16")
        if min(self.max_num_seqs, self.batch_size, self.max_waiting, self.kv_cache_mb) < 1:
            raise ConfigError(
                "[scheduler] max_num_seqs, batch_size, max_waiting, kv_cache_mb must be >= 1"
            )
        caps = (self.max_items, self.max_item_tiles, self.max_stop_strings, self.max_stop_bytes)
        if min(*caps, self.max_format_bytes, self.grammar_cache_size) < 1:
            raise ConfigError(
                "[scheduler] max_items, max_item_tiles, max_stop_strings, max_stop_bytes, "
                "max_format_bytes and grammar_cache_size must be >= 1"
            )
        if self.decode_step_tokens < 0:
            raise ConfigError("[scheduler] decode_step_tokens must be >= 0")
        if self.max_request_tokens < 1:
            raise ConfigError("[scheduler] max_request_tokens must be >= 1")
