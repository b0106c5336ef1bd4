"""Regenerate the committed gRPC stubs: `python -m protos.generate` (needs grpcio-tools).

The stubs are committed so that installing Folio never needs a protoc toolchain; a test
(tests/protos/test_protos.py::test_committed_stubs_are_fresh) regenerates them into a
temporary directory and fails if they differ. The proto is compiled with the repository root as include path, so the generated modules
import each other as `protos.folio.v1.*` while the protobuf package stays `folio.v1`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ["protos/folio/v1/generator.proto"]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # only needed by developers, not at run time

    for proto in PROTO_FILES:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(ROOT / proto),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
