"""Generate the Python code for protos/stagemesh/v1/*.proto, in place.

Run with `python protos/generate.py`; `--check` exits 1 when the committed code
is stale (CI runs that). -Iprotos makes the generated imports read
`from stagemesh.v1 import ..._pb2`, which pyproject maps onto this folder.
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "stagemesh" / "v1"


def generate(out_dir: Path) -> None:
    protos = sorted(str(p.relative_to(HERE)) for p in SOURCE.glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--mypy_out={out_dir}", f"--mypy_grpc_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the generated code is stale")
    check = parser.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "stagemesh" / "v1"
        names = sorted(p.name for p in fresh.iterdir() if p.suffix in (".py", ".pyi"))
        stale = [n for n in names if not (SOURCE / n).exists() or not filecmp.cmp(fresh / n, SOURCE / n, shallow=False)]
        extra = [p.name for p in SOURCE.glob("*_pb2*.py*") if p.name not in names]
        if check:
            if stale or extra:
                print(f"generated protobuf code is stale: {', '.join(stale + extra)}; run `python protos/generate.py`")
                return 1
            print("generated protobuf code is up to date")
            return 0
        for n in stale:
            shutil.copyfile(fresh / n, SOURCE / n)
        for n in extra:
            (SOURCE / n).unlink()
        print(f"regenerated {len(stale)} file(s), removed {len(extra)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
