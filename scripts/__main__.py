"""Command line of the stack tooling: `python3 -m scripts <command>` (the Makefile calls it)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scripts.common import Layout, StackError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and verify the pinned sdist and wheel")
    sub.add_parser("apply", help="build/vllm = pinned release + patches/series")
    sub.add_parser("patches", help="export build/vllm's commits to patches/")
    rebase = sub.add_parser("rebase", help="move the stack to another vLLM release")
    rebase.add_argument("version")
    drift = sub.add_parser("drift", help="try the stack on the newest vLLM release")
    drift.add_argument("version", nargs="?", default=None)
    sub.add_parser("overlay", help="regenerate vllm_overlay/ from build/vllm")
    install = sub.add_parser("install-overlay", help="copy vllm_overlay/ onto a vLLM")
    install.add_argument("target", type=Path, help="folder containing vllm/")
    install.add_argument("--dry-run", action="store_true")
    install.add_argument("--overlay", type=Path, default=None)
    sub.add_parser("check", help="fast self-check of the stack (no venv needed)")
    sub.add_parser("lock", help="regenerate requirements/venv.lock and lint.lock with pip")
    sub.add_parser("build", help="create .venv (patched vLLM) and .venv-lint (linters)")
    test = sub.add_parser("test", help="run every test suite against the patched vLLM "
                          "(rows whose inputs passed before are reused)")
    test.add_argument("--fresh", action="store_true",
                      help="run every row, reusing no earlier green result")
    sub.add_parser("export", help="build/export/: each patch signed off by $K3_SIGNOFF, "
                   "with its PR description")
    sub.add_parser("bench", help="time the everyday commands against their goals")
    sub.add_parser("clean", help="remove build/ and the venvs (refuses to lose work)")
    args = parser.parse_args(argv)
    layout = Layout.default()
    try:
        return _dispatch(layout, args) or 0
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; nothing half-done is kept as good", file=sys.stderr)
        return 130


def _dispatch(layout: Layout, args: argparse.Namespace) -> int | None:
    # Imports are local so that `check` and `apply` never need the venv's packages.
    if args.command == "fetch":
        from scripts.fetch import ensure_artifact
        from scripts.pin import load_pin

        pin = load_pin(layout.pin_file)
        for artifact in (pin.sdist, pin.wheel):
            print(ensure_artifact(layout, pin.project, artifact))
    elif args.command == "apply":
        from scripts.stack import apply

        apply(layout)
    elif args.command == "patches":
        from scripts.stack import export

        export(layout)
    elif args.command == "rebase":
        from scripts.rebase import rebase

        rebase(layout, args.version)
    elif args.command == "drift":
        from scripts.drift import drift

        return drift(layout, args.version)
    elif args.command == "overlay":
        from scripts.overlay import regenerate
        from scripts.pin import load_pin
        from scripts.series import read_series

        regenerate(layout, load_pin(layout.pin_file), [p.name for p in read_series(layout)])
    elif args.command == "install-overlay":
        from scripts.overlay import install

        install(args.overlay or layout.overlay_dir, args.target, args.dry_run)
    elif args.command == "check":
        from scripts.check import check

        return check(layout)
    elif args.command == "lock":
        from scripts.lock import generate

        generate(layout)
    elif args.command == "build":
        from scripts.venv import build

        build(layout)
    elif args.command == "test":
        from scripts.testrun import run_all

        return run_all(layout, fresh=args.fresh)
    elif args.command == "export":
        from scripts.export import export_for_upstream

        export_for_upstream(layout, os.environ.get("K3_SIGNOFF", ""))
    elif args.command == "bench":
        from scripts.bench import bench

        bench(layout)
    elif args.command == "clean":
        from scripts.clean import clean

        clean(layout)
    return None


if __name__ == "__main__":
    sys.exit(main())
