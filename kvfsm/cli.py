"""The ``kvfsm`` command: ``demo`` (the main job on loopback), ``check`` (model checker), ``docs``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfsm", description="Spec-driven KV-transfer protocol core")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvfsm import demo

    demo.add_arguments(
        sub.add_parser("demo", help="move N rooms of KV over the loopback transport and verify every byte")
    )
    from kvfsm.check import cli as check_cli

    check_cli.add_arguments(
        sub.add_parser("check", help="model-check the protocol: every interleaving, faults, invariants")
    )
    from kvfsm.check import replay as replay_cli

    replay_cli.add_arguments(
        sub.add_parser("replay", help="drive the runtime over loopback through a kvfsm check trace")
    )
    docs = sub.add_parser("docs", help="regenerate docs/ from spec/ (--check: fail if stale)")
    docs.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    if args.command == "check":
        return check_cli.main(args)
    if args.command == "replay":
        return replay_cli.main(args)
    if args.command == "docs":
        from kvfsm import docsgen

        return docsgen.main(["--check"] if args.check else [])
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
