"""`stagemesh rollout`: restart every service of a running `stagemesh serve`, one at a time, losing nothing."""
from __future__ import annotations

import argparse

from stagemesh.entry.ops import admin_client


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--surge", action="store_true",
                   help="add a replica for the rollout's time (needed by a mesh of one replica; removed at the end)")
    admin_client.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return admin_client.start(args, "/admin/rollout", {"surge": args.surge})
