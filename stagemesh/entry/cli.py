"""The `stagemesh` command line: one console script, a subcommand per job.

Each subcommand lives in the package that owns it and exposes
``add_arguments(parser)`` and ``run(args) -> int``; this module only
dispatches, so `stagemesh --help` does not import torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from stagemesh.core.default_model import cache_root
from stagemesh.core.errors import StagemeshError
from stagemesh.entry.supervisor import die_with_parent

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("stagemesh.entry.serve", "run the whole mesh (router, schedulers, stages) on this host"),
    "router": ("router.cli", "run one router: OpenAI HTTP gateway, gRPC frontend, DP balancing"),
    "scheduler": ("scheduler.cli", "run one replica's scheduler"),
    "stage": ("stage_worker.cli", "run one pipeline stage worker"),
    "generate": ("stagemesh.entry.generate", "answer one prompt in-process, without the mesh"),
    "plan": ("stagemesh.entry.plan.cli", "plan tensor/pipeline/data parallel sizes and their memory"),
    "bench": ("stagemesh.entry.bench.cli", "serving benchmark against a running router"),
    "rollout": ("stagemesh.entry.ops.rollout_cli",
                "restart every service of a running serve, one at a time, losing nothing"),
    "scale": ("stagemesh.entry.ops.scale_cli", "add or remove data-parallel replicas of a running serve"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagemesh", description="Distributed LLM inference as a gRPC mesh.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        command = sub.add_parser(name, help=help_text, description=help_text)
        module = _load(module_name)
        if module is not None:
            module.add_arguments(command)
            command.set_defaults(_run=module.run)
        command.set_defaults(_module=module_name)
    return parser


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            return None  # not built yet: run() reports it
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()  # a service a supervisor started (stagemesh.entry.supervisor) dies with it
    # the compiled CPU kernels build into the stagemesh cache, here and in every child process
    os.environ.setdefault("STAGEMESH_KERNEL_CACHE", str(cache_root() / "kernels"))
    # Import only the chosen subcommand's module (keeps --help fast).
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only=chosen)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        print(f"stagemesh: error: `stagemesh {args.command}` is not built yet ({args._module} is missing)",
              file=sys.stderr)
        return 2
    try:
        return int(run(args) or 0)
    except StagemeshError as err:
        print(f"stagemesh {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
