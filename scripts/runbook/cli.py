"""`python3 -m scripts runbook`: options, then the steps in order."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from scripts.common import Layout
from scripts.runbook import steps
from scripts.runbook.config import AITER_SWITCHES, MACHINES, REGIMES, SWEEP_REGIME, Config
from scripts.runbook.executor import Executor, SubprocessExecutor
from scripts.runbook.parse import ResultError


def parser() -> argparse.ArgumentParser:
    defaults = Config(MACHINES["mi300x"], Path("runbook-results"), Layout.default().root)
    p = argparse.ArgumentParser(
        prog="python3 -m scripts runbook",
        description="The hardware runbook (docs/hardware-runbook.md) on a ROCm machine: "
                    "A (vLLM release image) against B (with this stack's overlay).")
    p.add_argument("--machine", required=True, choices=sorted(MACHINES),
                   help="the GPUs: mi300x (gfx942) or mi355x (gfx950), 8 each")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: build/runbook-<machine>)")
    p.add_argument("--baseline-image", default=defaults.baseline_image, help="A")
    p.add_argument("--candidate-image", default=defaults.candidate_image,
                   help="B (make rocm-image)")
    p.add_argument("--test-image", default=None,
                   help="image for the device tests (default: B); needs vLLM's test "
                        "requirements: the overlay on vLLM's ROCm test image")
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--hf-cache", type=Path, default=defaults.hf_cache,
                   help="mounted as the containers' Hugging Face cache")
    p.add_argument("--engine", default=defaults.engine, choices=("docker", "podman"))
    p.add_argument("--steps", default=",".join(steps.NAMES),
                   help=f"comma-separated subset of {','.join(steps.NAMES)}")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="more environment for every server (the AITER switches "
                        f"{', '.join(AITER_SWITCHES)} come from --regimes)")
    p.add_argument("--regimes", default=None,
                   help="AITER regimes of the profile and accuracy steps, comma-separated, "
                        f"from {','.join(REGIMES)} (default: every one the machine honours; "
                        f"{SWEEP_REGIME}, which the tests, A/B and the sweep use, always)")
    p.add_argument("--serve-args", default="",
                   help="more `vllm serve` options for every server, e.g. "
                        "'--kv-cache-dtype fp8 --max-model-len 32768'")
    p.add_argument("--output-lens", default=_csv(defaults.output_lens))
    p.add_argument("--concurrencies", default=_csv(defaults.concurrencies))
    p.add_argument("--input-len", type=int, default=defaults.input_len)
    p.add_argument("--dataset-args", default=" ".join(defaults.dataset_args),
                   help="vllm bench serve dataset options, e.g. '--dataset-name spec_bench "
                        "--dataset-path /data/question.jsonl'")
    p.add_argument("--gsm8k-limit", type=int, default=None,
                   help="evaluate only the first N gsm8k problems (default: all 1319)")
    p.add_argument("--kernel-bench", default=" ".join(defaults.kernel_bench),
                   help="command of the draft-block attention benchmark, run in B")
    p.add_argument("--kernel-sweep", default=" ".join(defaults.kernel_sweep),
                   help="command of its tile sweep, run in B after it ('' for none)")
    p.add_argument("--server-ready-timeout", type=float,
                   default=defaults.server_ready_timeout)
    return p


def _csv(values) -> str:
    return ",".join(map(str, values))


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        raise SystemExit(f"runbook: {option} {text!r}: give positive integers, comma-separated")
    return values


def _positive(value, option: str, upper: float | None = None):
    """`value` if it is a number above 0 (and at most `upper`); nan and inf are not."""
    if value is None:
        return value
    if not (0 < value < float("inf") and (upper is None or value <= upper)):
        limit = f" and at most {upper:g}" if upper else ""
        raise SystemExit(f"runbook: {option} {value}: give a number above 0{limit}")
    return value


def _folder(path: Path, option: str) -> Path:
    """`path` with ~ expanded, absolute; it must be a folder if it exists."""
    expanded = Path(os.path.expanduser(path))  # unchanged if there is no such user
    if str(expanded).startswith("~"):
        raise SystemExit(f"runbook: {option} {str(path)!r}: no such user's home folder")
    if expanded.exists() and not expanded.is_dir():
        raise SystemExit(f"runbook: {option} {str(path)!r} exists and is not a folder")
    return expanded.resolve()


def _words(text: str, option: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as e:  # an open quote, a trailing backslash
        raise SystemExit(f"runbook: {option} {text!r}: {e} (quote as a shell would)")


def _regimes(text: str | None, gcn_arch: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(r.strip() for r in text.split(",") if r.strip())
    if unknown := [r for r in names if r not in REGIMES]:
        raise SystemExit(f"runbook: --regimes: unknown regime(s) {', '.join(unknown)}; "
                         f"known: {', '.join(REGIMES)}")
    if unfit := [r for r in names if gcn_arch not in REGIMES[r].archs]:
        raise SystemExit(f"runbook: --regimes: {', '.join(unfit)} needs "
                         f"{' or '.join(REGIMES[unfit[0]].archs)}; this machine is {gcn_arch}")
    return names


def config_from(layout: Layout, args: argparse.Namespace) -> Config:
    machine = MACHINES[args.machine]
    _positive(args.port, "--port", 65535)
    _positive(args.input_len, "--input-len")
    _positive(args.gsm8k_limit, "--gsm8k-limit")
    _positive(args.server_ready_timeout, "--server-ready-timeout")
    chosen = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    known = steps.NAMES
    if unknown := [s for s in chosen if s not in known]:
        raise SystemExit(f"runbook: unknown step(s) {', '.join(unknown)}; "
                         f"known: {', '.join(known)}")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"runbook: --env {item!r}: expected KEY=VALUE")
        if key in AITER_SWITCHES:
            raise SystemExit(f"runbook: --env {item!r}: the AITER switches are set per "
                             f"regime; choose regimes with --regimes ({','.join(REGIMES)})")
        env[key] = value
    regimes = _regimes(args.regimes, machine.gcn_arch)
    out = _folder(args.out or layout.build_dir / f"runbook-{machine.name}", "--out")
    return Config(
        machine=machine, out_dir=out, project_root=layout.root.resolve(),
        baseline_image=args.baseline_image, candidate_image=args.candidate_image,
        test_image=args.test_image,
        model=args.model, port=args.port, hf_cache=_folder(args.hf_cache, "--hf-cache"),
        engine=args.engine, steps=tuple(s for s in known if s in chosen), serve_env=env,
        regimes=regimes,
        serve_args=_words(args.serve_args, "--serve-args"),
        output_lens=_ints(args.output_lens, "--output-lens"),
        concurrencies=_ints(args.concurrencies, "--concurrencies"),
        input_len=args.input_len, dataset_args=tuple(args.dataset_args.split()),
        gsm8k_limit=args.gsm8k_limit, kernel_bench=tuple(args.kernel_bench.split()),
        kernel_sweep=tuple(args.kernel_sweep.split()),
        server_ready_timeout=args.server_ready_timeout)


def run(config: Config, executor: Executor, say=print) -> int:
    """Run the chosen steps in order; a failing step ends the run with one line.
    The report is written in every case from what was gathered."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    (config.out_dir / "plan.txt").write_text(steps.describe(config))
    rb = steps.Runbook(config, executor, say)
    failure = None
    chosen = steps.chosen(config)
    for step in chosen:
        if step.name == "report":
            continue
        try:
            step.run(rb)
        except (steps.StepError, ResultError) as e:
            failure = f"runbook: {step.name}: {e}"
            break
    if failure or any(step.name == "report" for step in chosen):
        steps.report(rb)
    if failure:
        print(failure, file=sys.stderr)
        print(f"runbook: results so far are in {config.out_dir}; run the same command "
              "again to resume", file=sys.stderr)
        return 1
    gate = rb.read_json("accuracy/gate.json")
    if gate and not all(g["passed"] for regime in gate["regimes"].values()
                        for g in regime["gates"].values()):
        print("runbook: an accuracy gate failed; see report/summary.md", file=sys.stderr)
        return 1
    return 0


def main(layout: Layout, argv: list[str]) -> int:
    args = parser().parse_args(argv)
    config = config_from(layout, args)
    if args.dry_run:
        print(steps.describe(config), end="")
        return 0
    return run(config, SubprocessExecutor())

