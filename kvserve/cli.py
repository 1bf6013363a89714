"""The ``kvserve`` command line: one subcommand per module, wired here."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvserve.frontend.generate_cli import register as register_generate
    register_generate(sub)
    from kvserve.server.cli import register as register_serve
    register_serve(sub)
    from kvserve.loadgen.cli import register as register_bench
    register_bench(sub)
    try:
        from kvserve.planner.cli import register as register_planner
    except ImportError:  # planner CLI not built yet
        register_planner = None
    if register_planner is not None:
        register_planner(sub)
    from kvserve.cluster.cli import register as register_cluster
    register_cluster(sub)
    from kvserve.coldstart.cli import register as register_coldstart
    register_coldstart(sub)
    from kvserve.fleetsim.cli import register as register_simulate
    register_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
