"""Generate Python gRPC stubs from protos/ into the llmesh package.

Generated files are build products: they are written next to the package sources
(llmesh/v1, llmesh/<area>/v1) and ignored by git, lint and type checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_root: Path = ROOT) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # imported late: only needed at build time

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Every directory holding generated modules becomes a regular package.
    made = []
    for proto in protos:
        rel = proto.relative_to(PROTO_ROOT).parent
        d = out_root / rel
        while d != out_root and d.is_relative_to(out_root / "llmesh"):
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
            d = d.parent
        made.append(out_root / rel)
    return made


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for d in generate(out):
        print(f"generated {d.relative_to(out)}")
