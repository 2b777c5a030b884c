"""Command line: ``hicache demo`` (the README's main job). More commands arrive with the cluster."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the multi-turn workload on the embedded default and print a table")
    demo.add_argument("--conversations", type=int, default=200)
    demo.add_argument("--turns", type=int, default=8)
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--capacity-tokens", type=int, default=200_000)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from hicache.demo import run_demo

        return run_demo(args)
    return 2
