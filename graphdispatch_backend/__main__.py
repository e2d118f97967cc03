"""Command line: `python -m graphdispatch_backend {demo, report, artifacts verify|hash|scaffold}`.

Only `demo` imports torch. `--help`, `report` (with `--regions`) and `artifacts
verify|hash|scaffold` read JSON and files: they import the modules they run, never the
package's torch-heavy ones, so they finish in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:  # zero steps would compare nothing and still say "bitwise equal"
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m graphdispatch_backend")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in example and compare with eager")
    demo.add_argument("--report-dir", default="gd_out", help="where the report goes (default: gd_out)")
    demo.add_argument("--steps", type=_steps, default=8, help="denoising steps, at least 1 (default: 8)")
    demo.add_argument("--fuse", action="store_true", help="fuse=True: Inductor's kernels, checked bit for bit")
    arts = sub.add_parser("artifacts", help="verify bundle roots, rehash a bundle, or scaffold one (authors)")
    arts_sub = arts.add_subparsers(dest="action", required=True)
    verify = arts_sub.add_parser("verify", help="print each bundle's verdict")
    verify.add_argument("roots", nargs="+")
    verify.add_argument("--report", default=None, metavar="DIR",
                        help="also match each manifest against the regions of this report directory")
    hasher = arts_sub.add_parser("hash", help="rewrite a bundle's files list from its folder")
    hasher.add_argument("bundle")
    scaffold = arts_sub.add_parser(
        "scaffold", help="write a bundle that reproduces a region of a report, bitwise, to edit from")
    scaffold.add_argument("directory", help="a report_dir (holds dispatch.json)")
    scaffold.add_argument("--region", required=True, metavar="PATTERN",
                          help="the region(s), as a manifest pattern (`layers.*.mlp`); it becomes region.module")
    scaffold.add_argument("--fingerprint", default=None, help="pick one kind when the pattern names several")
    scaffold.add_argument("--id", dest="artifact_id", default=None, help="artifact id (default: OUT's name)")
    scaffold.add_argument("out", help="the bundle folder to write (must not exist, or be empty)")
    report = sub.add_parser("report", help="render a report directory as tables")
    report.add_argument("directory")
    report.add_argument("--regions", nargs="?", const="*", default=None, metavar="PATTERN",
                        help="list every region (or those PATTERN matches) by kind, ready to copy into a manifest")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from graphdispatch_backend.examples.demo import run

        return run(args.report_dir, args.steps, fuse=args.fuse)
    if args.command == "artifacts":
        if args.action == "scaffold":
            from graphdispatch_backend.artifacts.scaffold import scaffold_command

            return scaffold_command(args.directory, args.region, args.out, args.fingerprint, args.artifact_id)
        from graphdispatch_backend.artifacts.cli import hash_command, verify_command

        return verify_command(args.roots, args.report) if args.action == "verify" else hash_command(args.bundle)
    if args.regions is not None:
        from graphdispatch_backend.artifacts.catalog import catalog_command

        return catalog_command(args.directory, args.regions)
    from graphdispatch_backend.diagnostics.render import report_command

    return report_command(args.directory)


def _piped() -> int:
    """`main`, where a reader that stops early (`report DIR | head`) ends it quietly, as a
    Unix tool does, not with a BrokenPipeError traceback."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at nothing first (the `signal` docs' recipe)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a tool the pipe closed on
    return code


if __name__ == "__main__":
    sys.exit(_piped())
