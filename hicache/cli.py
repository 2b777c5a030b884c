"""Command line: ``hicache demo`` (the README's main job). More commands arrive with the cluster."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="multi-turn chat through L1/L2/L3 with the reference engine (embedded)")
    demo.add_argument("--conversations", type=int, default=16)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--output-tokens", type=int, default=8)
    demo.add_argument("--l3-dir", default=".hicache/l3", help="local directory used as L3 (file://)")
    demo.add_argument("--keep-l3", action="store_true", help="reuse what an earlier run left in --l3-dir")
    demo.add_argument("--plot", default="hicache-demo.png")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from hicache.demo import run_demo

        return run_demo(args)
    return 2
