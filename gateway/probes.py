"""Probe results the gateway has already seen, so that a repeat of the same bytes (a cache hit at
the core, a second question about one image) runs no worker job at all.

A result depends only on the exact bytes and on the arguments that shaped the probe (format and
limits), so both are in the key; so is the tenant, so that how fast a request is answered never
tells one tenant what another has sent. Bounded, least recently used first out, per process.
"""

from __future__ import annotations

import collections
import json
from typing import Any

from gateway.decode import Probe

MAX_ENTRIES = 4096  # about 1 MiB of keys and results


class ProbeCache:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, str, str], Probe] = (
            collections.OrderedDict()
        )

    @staticmethod
    def key(tenant: str, content_hash: str, args: dict[str, Any]) -> tuple[str, str, str]:
        return tenant, content_hash, json.dumps(args, sort_keys=True)

    def get(self, key: tuple[str, str, str]) -> Probe | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: tuple[str, str, str], probe: Probe) -> None:
        self._entries[key] = probe
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
