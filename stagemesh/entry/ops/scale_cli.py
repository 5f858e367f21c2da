"""`stagemesh scale --data-parallel-size N`: add or remove replicas of a running `stagemesh serve`."""
from __future__ import annotations

import argparse

from stagemesh.entry.ops import admin_client


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-parallel-size", "-dp", type=int, required=True, metavar="N",
                   help="the replicas the mesh is to have")
    admin_client.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return admin_client.start(args, "/admin/scale", {"data_parallel_size": args.data_parallel_size})
