"""The ``kvfsm`` command: ``kvfsm demo`` (the main job on loopback) and ``kvfsm docs``."""

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
    docs = sub.add_parser("docs", help="regenerate docs/ from spec/ (--check: fail if stale)")
    docs.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    if args.command == "docs":
        from kvfsm import docsgen

        return docsgen.main(["--check"] if args.check else [])
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
