"""The core's configuration sections: `[core]` and `[cache]`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shared.config import ConfigError
from shared.net import is_loopback, split_host_port


@dataclass(frozen=True, slots=True)
class CoreConfig:
    listen: str = "127.0.0.1:50052"  # gRPC address; loopback by default
    model: str = "models/demo"  # llava-hf checkpoint directory
    core_id: str = ""  # reported as served_by; empty = "<hostname>:<port>"
    metrics_listen: str = "127.0.0.1:9102"  # Prometheus endpoint; empty disables it
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    grace_s: float = 5.0  # how long shutdown waits for requests in flight

    def validate(self) -> None:
        split_host_port(self.listen)
        if self.num_threads < 0 or self.grace_s < 0:
            raise ConfigError("[core] num_threads and grace_s must be >= 0")
        if not is_loopback(self.listen):
            # mTLS lands with the deployment work; until then only loopback is safe.
            raise ConfigError("[core] listen must be a loopback address until mTLS is configured")

    def resolved_core_id(self) -> str:
        return self.core_id or f"{os.uname().nodename}:{split_host_port(self.listen)[1]}"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    path: str = "~/.cache/visor/features"  # LMDB directory of the feature cache

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("[cache] path must not be empty")
