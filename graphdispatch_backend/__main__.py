"""Command line: `python -m graphdispatch_backend {demo, artifacts verify|hash, report}`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphdispatch_backend")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in example and compare with eager")
    demo.add_argument("--report-dir", default="gd_out")
    demo.add_argument("--steps", type=int, default=8)
    arts = sub.add_parser("artifacts", help="verify bundle roots, or rehash a bundle (authors)")
    arts_sub = arts.add_subparsers(dest="action", required=True)
    verify = arts_sub.add_parser("verify", help="print each bundle's verdict")
    verify.add_argument("roots", nargs="+")
    hasher = arts_sub.add_parser("hash", help="rewrite a bundle's files list from its folder")
    hasher.add_argument("bundle")
    report = sub.add_parser("report", help="render a report directory as tables")
    report.add_argument("directory")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from graphdispatch_backend.examples.demo import run

        return run(args.report_dir, args.steps)
    if args.command == "artifacts":
        from graphdispatch_backend.artifacts.cli import hash_command, verify_command

        return verify_command(args.roots) if args.action == "verify" else hash_command(args.bundle)
    from graphdispatch_backend.diagnostics.render import report_command

    return report_command(args.directory)


if __name__ == "__main__":
    sys.exit(main())
