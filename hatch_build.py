"""Hatch build hook: generates the protobuf modules, so wheels and editable installs carry them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ProtoBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "protos"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        sys.path.insert(0, self.root)
        try:
            from shared import protogen

            protogen.generate(Path(self.root) / "protos", Path(self.root) / "shared" / "pb")
        finally:
            sys.path.remove(self.root)
        build_data.setdefault("artifacts", []).append("shared/pb/**")
