"""The shape of the code, against issue 47's targets: function length (p50, p90, max), files past 350 lines,
and, per model family, the files outside its own module that name it.

    .venv/bin/python benchmarks/code_shape.py [--top 10]

Counts the five packages' Python files (not generated protobuf, not tests). A function's length is its lines
from `def` to its last line, decorators and docstring included; a nested function counts in its parent and
again on its own.
"""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stagemesh", "router", "scheduler", "stage_worker", "kernels")
FILE_LIMIT = 350
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "gemma")


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")) and "/v1/" not in str(p))


def functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def family_files(paths: list[Path]) -> dict[str, list[str]]:
    """Files that name a family as a string literal ('qwen3', "mixtral"), outside a module named after it."""
    found: dict[str, list[str]] = {}
    for path in paths:
        text = path.read_text()
        for family in FAMILIES:
            if path.stem == family:
                continue
            if re.search(rf"""["']{family}["']""", text):
                found.setdefault(family, []).append(str(path.relative_to(ROOT)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10, help="the longest functions and files listed")
    args = parser.parse_args()
    paths = sources()
    funcs = [f for p in paths for f in functions(p)]
    lengths = [n for n, _ in funcs]
    print(f"{len(paths)} files, {sum(len(p.read_text().splitlines()) for p in paths)} lines, {len(funcs)} functions")
    print(f"function length: p50 {percentile(lengths, 0.5)}, p90 {percentile(lengths, 0.9)}, "
          f"max {max(lengths)} (targets: p90 <= 20, max <= 60); over 60: {sum(n > 60 for n in lengths)}")
    for n, name in sorted(funcs, reverse=True)[:args.top]:
        print(f"  {n:4d}  {name}")
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in paths), reverse=True)
    over = [s for s in sizes if s[0] > FILE_LIMIT]
    print(f"files over {FILE_LIMIT} lines: {len(over)}")
    for n, name in over[:args.top]:
        print(f"  {n:4d}  {name}")
    print("files naming a model family outside its own module:")
    for family, files in family_files(paths).items():
        print(f"  {family:10s} {len(files):2d}  {' '.join(files)}")


if __name__ == "__main__":
    main()
