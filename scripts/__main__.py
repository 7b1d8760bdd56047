"""Command line of the stack tooling: `python3 -m scripts <command>` (the Makefile calls it)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scripts.common import Layout, StackError, Terminated, handle_termination, remove_leftovers
from scripts.mutex import project_lock

# Commands that write nothing of the project's own (build/, .cache/, vllm_overlay/).
_UNLOCKED = {"install-overlay"}
# Commands that write what a `make rebase` in progress owns, or act on build/vllm
# as if no rebase were in progress: refused until it is finished or given up.
_WAIT_FOR_REBASE = {"apply", "patches", "overlay", "export", "check", "clean", "lock",
                    "build", "test"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and verify the pinned sdist and wheel")
    sub.add_parser("apply", help="build/vllm = pinned release + patches/series")
    sub.add_parser("patches", help="export build/vllm's commits to patches/")
    rebase = sub.add_parser("rebase", help="move the stack to another vLLM release")
    rebase.add_argument("version", nargs="?")
    rebase.add_argument("--abandon", action="store_true",
                        help="give up the rebase in progress (its work kept as a branch)")
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
    test.add_argument("--only", default="", metavar="ROW[,ROW...]",
                      help="run only these rows, named as the summary names them")
    sub.add_parser("export", help="build/export/: each patch signed off by $K3_SIGNOFF, "
                   "with its PR description")
    sub.add_parser("bench", help="time the everyday commands against their goals")
    mutate = sub.add_parser("mutate", help="put back each defect the review found, one at a "
                            "time, and report what in make test catches it")
    mutate.add_argument("names", nargs="*", metavar="MUTATION", help="default: all")
    mutate.add_argument("--project", type=Path, default=None,
                        help="test with this checkout's make test (default: this project)")
    mutate.add_argument("--fresh", action="store_true", help="reuse no green result")
    gpubench = sub.add_parser(
        "gpubench", help="time the stack's GPU kernels against the release, side by side")
    gpubench.add_argument("--case", action="append",
                          help="benchmark case, repeatable (default: all; without amd-aiter "
                          "installed, all that need none)")
    gpubench.add_argument("--package", type=Path, default=None,
                          help="folder to build the package in (default: build/gpubench)")
    gpubench.add_argument("--source", type=Path, default=None,
                          help="vLLM git repository to read (default: build/vllm)")
    gpubench.add_argument("--rev", action="append", default=[], metavar="LABEL=REV",
                          help="one more tree to time: a revision of build/vllm "
                          "(older=HEAD~1) or else a project commit, its patches/ stack "
                          "applied to the release as for --before (landed=4dd980a)")
    gpubench.add_argument("--before", default="auto", metavar="REV|auto|none",
                          help="the tree 'before': the stack at this project commit; auto "
                          "(default): the previous landed revision of the timed files")
    gpubench.add_argument("--build-only", action="store_true",
                          help="build the package; do not run it")
    sub.add_parser("gpu-tables", help="rewrite BENCHMARKS.md's GPU tables from their logs "
                   "in benchmarks/gpu/results/")
    clean = sub.add_parser("clean", help="remove build/ and the venvs (refuses to lose work)")
    clean.add_argument("--force", action="store_true",
                       help="also delete work that exists only in build/vllm (named first)")
    clean.add_argument("--forced-by-make", type=int, metavar="MAKE_PID",
                       help="make got FORCE=1: force only if make's own command line "
                            "holds it (not MAKEFLAGS or the environment)")
    image = sub.add_parser("rocm-image", help="build a ROCm image with the stack "
                           "(BASE_IMAGE, IMAGE_TAG from the environment)")
    image.add_argument("--source", action="store_true",
                       help="vLLM's Dockerfile.rocm on build/vllm instead of the overlay recipe")
    image.add_argument("--dry-run", action="store_true", help="print the commands only")
    # Listed for --help; its own parser reads its options (scripts/runbook/cli.py).
    sub.add_parser("runbook", help="the hardware runbook on a ROCm machine "
                   "(docs/hardware-runbook.md); see `runbook --help`")
    argv = sys.argv[1:] if argv is None else argv
    # git output that is not UTF-8 is carried with surrogate escapes (common.run);
    # printed, it shows as escapes, never as a UnicodeEncodeError.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(errors="backslashreplace")
    layout = Layout.default()
    if argv[:1] == ["runbook"]:
        from scripts.runbook.cli import main as runbook_main

        return runbook_main(layout, argv[1:])
    args = parser.parse_args(argv)
    handle_termination()
    try:
        if args.command in _UNLOCKED:
            return _dispatch(layout, args) or 0
        with project_lock(layout, args.command):
            for folder in (layout.root, layout.build_dir, layout.patches_dir):
                remove_leftovers(folder)  # from runs that were killed
            if args.command in _WAIT_FOR_REBASE:
                from scripts.stack.gitrepo import refuse_during_rebase

                refuse_during_rebase(layout, args.command)
            return _dispatch(layout, args) or 0
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        # A file system error no check foresaw (a full disk, a permission):
        # say which file, not a traceback.
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}; fix that and run the command again",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Terminated) else 2
        print(f"{'interrupted' if signum == 2 else f'terminated ({e})'}; nothing half-done "
              "is kept as good",
              file=sys.stderr)
        return 128 + signum


def _dispatch(layout: Layout, args: argparse.Namespace) -> int | None:
    # Imports are local so that `check` and `apply` never need the venv's packages.
    if args.command == "fetch":
        from scripts.stack.fetch import ensure_artifact
        from scripts.stack.pin import load_pin

        pin = load_pin(layout.pin_file)
        for artifact in (pin.sdist, pin.wheel):
            print(ensure_artifact(layout, pin.project, artifact))
    elif args.command == "apply":
        from scripts.stack.apply import apply

        apply(layout)
    elif args.command == "patches":
        from scripts.stack.apply import export_patches

        export_patches(layout)
    elif args.command == "rebase":
        from scripts.stack.rebase import abandon, rebase

        if args.abandon:
            abandon(layout)
        elif args.version is None:
            raise StackError("usage: make rebase VLLM_VERSION=x.y.z (or make rebase-abandon)")
        else:
            rebase(layout, args.version)
    elif args.command == "drift":
        from scripts.stack.drift import drift

        return drift(layout, args.version or None)
    elif args.command == "overlay":
        from scripts.stack.overlay import regenerate
        from scripts.stack.pin import load_pin
        from scripts.stack.series import read_series

        regenerate(layout, load_pin(layout.pin_file), [p.name for p in read_series(layout)])
    elif args.command == "install-overlay":
        from scripts.stack.overlay import install

        install(args.overlay or layout.overlay_dir, args.target, args.dry_run)
    elif args.command == "check":
        from scripts.stack.check import check

        return check(layout)
    elif args.command == "lock":
        from scripts.stack.lock import generate

        generate(layout)
    elif args.command == "build":
        from scripts.stack.venv import build

        build(layout)
    elif args.command == "test":
        from scripts.testing.testrun import run_all

        return run_all(layout, fresh=args.fresh, only=args.only)
    elif args.command == "export":
        from scripts.stack.export import export_for_upstream

        export_for_upstream(layout, os.environ.get("K3_SIGNOFF", ""))
    elif args.command == "mutate":
        from scripts.testing.mutate import mutate

        return mutate(layout, args.names, args.project, args.fresh)
    elif args.command == "bench":
        from scripts.perf.bench import bench

        bench(layout)
    elif args.command == "gpubench":
        from scripts.perf.gpubench import gpubench

        return gpubench(layout, args.case, args.package, args.source, args.rev,
                        args.build_only, args.before)
    elif args.command == "gpu-tables":
        from scripts.perf.gpu_tables import gpu_tables

        gpu_tables(layout)
    elif args.command == "clean":
        from scripts.stack.clean import clean, force_typed

        clean(layout, force=args.force or (args.forced_by_make is not None
                                           and force_typed(args.forced_by_make)))
    elif args.command == "rocm-image":
        from scripts.image.rocm_image import build_image

        build_image(layout, source=args.source, dry_run=args.dry_run)
    return None


if __name__ == "__main__":
    sys.exit(main())
