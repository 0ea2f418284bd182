"""Generates the protobuf and gRPC modules from `protos/` into `shared/pb/` (never committed).

Used by the build hook (`hatch_build.py`), by `make protos`, and on first import when a source
checkout has not been built yet.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "shared" / "pb"
_ABSOLUTE_IMPORT = re.compile(r"^from visor\.v1 import ", re.MULTILINE)


def generate(proto_dir: Path = PROTO_DIR, out_dir: Path = OUT_DIR) -> list[Path]:
    """Runs grpc_tools.protoc over every .proto; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency only

    protos = sorted(proto_dir.rglob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(p.name for p in protos))
    written = sorted(p for p in out_dir.rglob("*") if p.suffix in {".py", ".pyi"})
    for path in written:
        # protoc writes absolute imports (`from visor.v1 import x`); the package lives under
        # shared.pb, so make them relative.
        text = path.read_text()
        fixed = _ABSOLUTE_IMPORT.sub("from . import ", text)
        if fixed != text:
            path.write_text(fixed)
    for folder in {out_dir, *(p.parent for p in written)}:
        while True:
            (folder / "__init__.py").touch()
            if folder == out_dir:
                break
            folder = folder.parent
    return written


if __name__ == "__main__":
    for written_path in generate():
        print(written_path.relative_to(ROOT))
    sys.exit(0)
