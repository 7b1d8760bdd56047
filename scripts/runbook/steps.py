"""The runbook's steps. Each takes a Runbook (config + executor) and writes its
results under the output folder as they arrive; a step whose results exist is
skipped, so a second run resumes where the first stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path

from scripts.runbook import checks, parse, plan
from scripts.runbook.config import REGIMES, Config
from scripts.runbook.executor import Executor, Result

_POLL_SECONDS = 10
_ROCM_SKIP = re.compile(r"\brocm\b|\bhip\b|\bamd\b|\bmi3\d\d", re.IGNORECASE)


class StepError(Exception):
    """A step cannot go on; the message is one line naming the file or command."""


class Runbook:
    def __init__(self, config: Config, executor: Executor, say=print) -> None:
        self.config, self.executor, self.say = config, executor, say
        self.out = config.out_dir

    # --- files ---------------------------------------------------------------

    def path(self, relative: str) -> Path:
        return self.out / relative

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, self.out)

    def write_json(self, relative: str, data) -> Path:
        """Write all or nothing: a reader never sees half a file."""
        target = self.path(relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(partial, target)
        return target

    def read_json(self, relative: str) -> dict | None:
        try:
            return json.loads(self.path(relative).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def exists(self, pattern: str) -> bool:
        return any(self.out.glob(pattern))

    def done(self, command: plan.Command) -> bool:
        """Whether the command's results are all there already (resume)."""
        return bool(command.done) and all(self.exists(p) for p in command.done)

    # --- commands ------------------------------------------------------------

    def run(self, command: plan.Command) -> Result | None:
        """Run one command (None: skipped, its results exist); record it."""
        if self.done(command):
            self.say(f"  skip: {command.title} (results exist: {', '.join(command.done)})")
            return None
        self.say(f"  run:  {command.title}")
        result = self._execute(command.argv, command.timeout, parse.slug(command.title),
                               command.kind, command.meta)
        if command.check and result.returncode != 0:
            raise StepError(f"{command.title}: {_exit(result, command.timeout)}; "
                            f"log: {self.rel(self._log(parse.slug(command.title)))}")
        missing = [p for p in command.done if not self.exists(p)]
        if result.returncode == 0 and missing:
            raise StepError(f"{command.title}: finished but wrote no {missing[0]}; log: "
                            f"{self.rel(self._log(parse.slug(command.title)))}")
        return result

    def _log(self, name: str) -> Path:
        return self.path(f"logs/{name}.log")

    def _execute(self, argv: list[str], timeout: float, name: str, kind: str = "",
                 meta: dict | None = None) -> Result:
        start = self.executor.now()
        result = self.executor.run(argv, timeout=timeout, log=self._log(name), kind=kind,
                                   meta=meta or {})
        seconds = self.executor.now() - start
        self.path("commands.log").parent.mkdir(parents=True, exist_ok=True)
        with open(self.path("commands.log"), "a") as record:
            record.write(f"{self.executor.timestamp()}  exit {result.returncode}  "
                         f"{seconds:.0f}s  {shlex.join(argv)}\n")
        return result

    # --- servers -------------------------------------------------------------

    @contextlib.contextmanager
    def serving(self, srv: plan.Server | None):
        if srv is None:
            yield
            return
        engine = self.config.engine
        self._execute([engine, "rm", "--force", srv.container], 120, f"{srv.container}-rm")
        if self.executor.http_status(srv.health_url) is not None:
            raise StepError(f"something already answers on {srv.health_url}: stop it, or "
                            "give the runbook another --port")
        self.say(f"  serve: {srv.config} from {srv.image} on port {srv.port}")
        started = self._execute(srv.start, 600, f"{srv.container}-start", "server",
                                {"config": srv.config})
        if started.returncode != 0:
            last = (started.output.strip().splitlines() or ["no output"])[-1]
            raise StepError(f"server {srv.config}: `{engine} run` of {srv.image} failed: {last}")
        try:
            self._wait_ready(srv)
            yield
        finally:
            self._execute([engine, "logs", srv.container], 300, srv.container)
            self._execute([engine, "rm", "--force", srv.container], 120,
                          f"{srv.container}-rm")

    def _wait_ready(self, srv: plan.Server) -> None:
        deadline = self.executor.now() + srv.ready_timeout
        inspect = [self.config.engine, "inspect", "--format={{.State.Running}}", srv.container]
        while True:
            if self.executor.http_status(srv.health_url) == 200:
                return
            running = self._execute(inspect, 60, f"{srv.container}-inspect", "inspect")
            log = self.rel(self._log(srv.container))
            if running.output.strip() != "true":
                raise StepError(f"server {srv.config} ({srv.image}) exited before it was ready; "
                                f"its log: {log}")
            if self.executor.now() >= deadline:
                raise StepError(f"server {srv.config} ({srv.image}) was not ready after "
                                f"{srv.ready_timeout:.0f} s ({srv.health_url}); its log: {log}")
            self.executor.sleep(_POLL_SECONDS)

    def sessions(self, sessions: list[plan.Session]) -> None:
        for session in sessions:
            self.say(f"{session.title}")
            if all(self.done(c) for c in session.commands):
                self.say("  skip: all results exist")
                continue
            with self.serving(session.server):
                for command in session.commands:
                    self.run(command)


def _exit(result: Result, timeout: float) -> str:
    if result.returncode == 124:
        return f"timed out after {timeout:.0f} s"
    last = next((ln.strip() for ln in reversed(result.output.splitlines()) if ln.strip()), "")
    return f"exited {result.returncode}" + (f" ({last[:160]})" if last else "")


# --- 0. preflight ---------------------------------------------------------------


def preflight(rb: Runbook) -> None:
    (session,) = plan.preflight(rb.config)
    images = {c.meta["config"]: c.argv[-1] for c in session.commands if c.kind == "image"}
    found = rb.read_json("preflight/versions.json")
    if found and {k: v.get("image") for k, v in found.items()} == images:
        rb.say("0. preflight\n  skip: preflight/versions.json has these images")
        return
    rb.say(session.title)
    versions: dict = {}
    for command in session.commands:
        result = rb.run(command)
        assert result is not None  # preflight commands have no results to resume from
        if command.kind == "image":
            versions[command.meta["config"]] = {"image": command.argv[-1],
                                                "image_id": result.output.strip()}
        elif command.kind == "probe":
            versions[command.meta["config"]].update(_probe_output(command, result))
    _check_images(rb.config, versions)
    rb.write_json("preflight/versions.json", versions)


def _probe_output(command: plan.Command, result: Result) -> dict:
    for line in reversed(result.output.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise StepError(f"{command.title}: the probe printed no JSON line")


def _check_images(config: Config, versions: dict) -> None:
    manifest = json.loads((config.project_root / "vllm_overlay/MANIFEST.json").read_text())
    want = manifest["vllm_version"]
    amd = "vllm.models.kimi_k3.amd.dspark_mla"
    for label, v in versions.items():
        image = config.image(label)
        if str(v.get("vllm", "")).split("+")[0] != want:
            raise StepError(f"image {label} ({image}) holds vLLM {v.get('vllm')}, "
                            f"the runbook compares vLLM {want}")
        arch = str(v.get("gcn_arch") or "")
        if not arch.startswith(config.machine.gcn_arch):
            raise StepError(f"image {label} sees GPU {arch or 'none'}, --machine "
                            f"{config.machine.name} is {config.machine.gcn_arch}")
        drafter = set((v.get("drafter") or {}).values())
        if (label != "A") != (drafter == {amd}):
            raise StepError(f"image {label} ({image}) resolves the K3 DSpark drafter to "
                            f"{sorted(map(str, drafter))}: A must be the release, B the "
                            "release with the overlay (make rocm-image)")
    tests = versions.get("tests", versions["B"])
    if not tests.get("pytest") and "tests" in (s.name for s in chosen(config)):
        raise StepError(f"image {config.tests_image} has no pytest: give --test-image, the "
                        "overlay on vLLM's ROCm test image (make rocm-image "
                        "BASE_IMAGE=<that image>)")


# --- 1. tests -------------------------------------------------------------------


def tests(rb: Runbook) -> None:
    summary = rb.read_json("tests/summary.json")
    if summary and summary["ok"]:
        rb.say("1. device tests (B)\n  skip: tests/summary.json exists and passed")
        return
    tree = rb.config.project_root / "build" / "vllm"
    if not (tree / "tests").is_dir():
        raise StepError(f"{tree}/tests is missing: run `make apply` on this machine first "
                        "(the device tests come from the patched tree)")
    rb.path("tests/junit.xml").unlink(missing_ok=True)
    rb.sessions(plan.tests(rb.config))
    run = parse.junit(rb.path("tests/junit.xml"))
    rocm_skipped = [(t, r) for t, r in run.skipped if _ROCM_SKIP.search(r)]
    ok = run.failed == 0 and not rocm_skipped and run.passed > 0
    rb.write_json("tests/summary.json", {
        "ok": ok, "passed": run.passed, "failed": run.failed,
        "skipped": [{"test": t, "reason": r} for t, r in run.skipped],
        "rocm_only_skipped": [t for t, _ in rocm_skipped]})
    if rocm_skipped:
        raise StepError(f"ROCm-only test skipped on the ROCm machine: {rocm_skipped[0][0]} "
                        f"({rocm_skipped[0][1]}); see tests/summary.json")
    if not ok:
        raise StepError(f"device tests: {run.failed} failed, {run.passed} passed; "
                        "see logs/the-stack-s-vllm-tests-in-b.log")


# --- 2. profile -----------------------------------------------------------------


def profile(rb: Runbook) -> None:
    """B's decode under each AITER regime; every regime's trace must meet the
    expectations its flags set (checks.EXPECTATIONS)."""
    regimes = [r.name for r in rb.config.matrix]
    summary = rb.read_json("profile/summary.json")
    if summary and summary["ok"] and list(summary["regimes"]) == regimes:
        rb.say("2. profile (B)\n  skip: profile/summary.json exists and passed")
        return
    rb.sessions(plan.profile(rb.config))
    results = {regime: _profile_regime(rb, regime) for regime in regimes}
    ok = all(r["ok"] for r in results.values())
    rb.write_json("profile/summary.json", {"ok": ok, "regimes": results})
    if not ok:
        regime, result = next((k, v) for k, v in results.items() if not v["ok"])
        failed = next(v for v in result["checks"] if not v["ok"])
        raise StepError(f"profile ({regime}): {failed['check']}: {failed['detail'][:200]}; "
                        "see profile/summary.json")


def _profile_regime(rb: Runbook, regime: str) -> dict:
    folder = f"profile/{regime}"
    drafts = parse.bench_result(rb.path(f"{folder}/bench.json"))["spec_decode_num_drafts"]
    env = rb.config.env(regime)
    flags = checks.AiterFlags.from_env(env, rb.config.machine.gcn_arch)
    per_rank, roles = {}, {}
    for path in sorted(rb.out.glob(f"{folder}/trace/**/*.pt.trace.json*")):
        trace = parse.chrome_trace(path)
        if trace.kernels:  # the frontend's CPU-only trace has none
            per_rank[rb.rel(path)] = checks.check_trace(
                trace, int(drafts) if drafts is not None else None, flags)
            roles = roles or checks.kernels_by_role(trace)  # the first rank's
    if not per_rank:
        raise StepError(f"profile ({regime}): no trace with GPU kernels under {folder}/trace/; "
                        f"see logs/k3-runbook-b-{regime}-profile.log")
    names = [v.name for v in next(iter(per_rank.values()))]
    verdicts = [{"check": name,
                 "ok": all(vs[i].ok for vs in per_rank.values()),
                 "detail": "; ".join(f"{Path(f).name}: {vs[i].detail}"
                                     for f, vs in per_rank.items())}
                for i, name in enumerate(names)]
    return {"ok": all(v["ok"] for v in verdicts), "env": env, "drafts": drafts,
            "flags": dataclasses.asdict(flags), "traces": list(per_rank),
            "checks": verdicts, "kernels": roles}


# --- 3. accuracy ----------------------------------------------------------------


def accuracy(rb: Runbook) -> None:
    """gsm8k per regime: B (and, in the sweep's regime, A) against the target
    without speculative decoding served the same way."""
    rb.sessions(plan.accuracy(rb.config))
    regimes: dict = {}
    for regime, label in plan.accuracy_runs(rb.config):
        folder = rb.path(f"accuracy/{regime}/{label}")
        acc = parse.lm_eval_gsm8k(label, parse.latest_lm_eval_results(folder))
        samples = sorted(folder.glob("*/samples_gsm8k_*.jsonl"))
        entry = regimes.setdefault(regime, {"env": REGIMES[regime].env, "results": {},
                                            "gates": {}, "_acc": {}})
        entry["_acc"][label] = acc
        entry["results"][label] = {
            "scores": acc.scores, "stderrs": acc.stderrs, "samples": acc.samples,
            "file": rb.rel(acc.file),
            "repetitive": parse.repetitive_fraction(samples[-1]) if samples else None}
    for regime, entry in regimes.items():
        found = entry.pop("_acc")
        for label in (k for k in found if k != "ref"):
            g = checks.accuracy_gate(found[label], found["ref"], rb.config.noise_sigmas)
            entry["gates"][label] = {"passed": g.passed, "lines": g.lines}
            rb.say(f"  gate {label} ({regime}): {'passed' if g.passed else 'FAILED'}; "
                   + "; ".join(g.lines))
    rb.write_json("accuracy/gate.json", {"noise_sigmas": rb.config.noise_sigmas,
                                         "sweep_regime": rb.config.sweep_regime,
                                         "regimes": regimes})


def passed_gate(rb: Runbook) -> tuple[str, ...]:
    """The configurations whose gate passed in the sweep's regime."""
    gate = rb.read_json("accuracy/gate.json")
    if gate is None:
        raise StepError("no accuracy gate (accuracy/gate.json): run the accuracy step first; "
                        "performance is measured only for configurations that pass it")
    gates = gate["regimes"].get(rb.config.sweep_regime, {}).get("gates", {})
    if set(gates) != {"A", "B"}:
        raise StepError(f"accuracy/gate.json has no A/B gate for the sweep's regime "
                        f"{rb.config.sweep_regime}: run the accuracy step again")
    return tuple(k for k in ("A", "B") if gates[k]["passed"])


# --- 4. sweep and kernel benchmark ----------------------------------------------


def sweep(rb: Runbook) -> None:
    labels = passed_gate(rb)
    for label in ("A", "B"):
        if label not in labels:
            rb.say(f"4. sweep: {label} failed its accuracy gate: no performance measured")
    sessions = plan.sweep(rb.config, labels)
    rb.sessions(sessions)
    for session in sessions:
        for command in session.commands:
            parse.bench_result(rb.path(command.done[0]))  # a malformed file stops here


def kernels(rb: Runbook) -> None:
    if rb.read_json("kernels/summary.json"):
        rb.say("4b. kernel benchmark (B)\n  skip: kernels/summary.json exists")
        return
    (session,) = plan.kernels(rb.config)
    command, *sweep = session.commands
    rb.say(session.title)
    result = rb.run(command)
    assert result is not None
    if result.returncode != 0:
        if re.search(r"invalid choice|No module named|can't open file", result.output):
            rb.write_json("kernels/summary.json", {
                "available": False, "command": command.argv,
                "reason": "the project has no such benchmark (optional)"})
            rb.say("  the kernel benchmark is not available: skipped (optional)")
            return
        raise StepError(f"{command.title}: {_exit(result, command.timeout)}; log: "
                        f"logs/{parse.slug(command.title)}.log")
    rb.path("kernels").mkdir(parents=True, exist_ok=True)
    rb.path("kernels/output.txt").write_text(result.output)
    best_tiles = []
    for command_ in sweep:  # the tile sweep, if configured
        swept = rb.run(command_)
        assert swept is not None
        if swept.returncode != 0:
            raise StepError(f"{command_.title}: {_exit(swept, command_.timeout)}; log: "
                            f"logs/{parse.slug(command_.title)}.log")
        rb.path("kernels/sweep.txt").write_text(swept.output)
        best_tiles = parse.best_tiles(swept.output)
    rb.write_json("kernels/summary.json", {"available": True, "command": command.argv,
                                           "rows": parse.kernel_table(result.output),
                                           "best_tiles": best_tiles})


# --- 4c. the draft's attention backend (MI355X) ---------------------------------


def draft_attention(rb: Runbook) -> None:
    """AITER's non-causal draft decode against TRITON_MLA's: a device test, then
    B served with each draft backend; the verdict by checks.DRAFT_RULE."""
    config, folder = rb.config, plan.DRAFT_FOLDER
    check, *serving = plan.draft_attention(config)
    if not plan.draft_applies(config):
        rb.say(f"{check.title}\n  skip: {check.note}")
        rb.write_json(f"{folder}/summary.json", {"applies": False,
                                                 "arch": config.machine.gcn_arch})
        return
    rb.sessions([check])
    tested = _draft_test(rb)
    rb.sessions(serving)
    runs = {s.commands[0].meta["backend"]: _draft_run(rb, s) for s in serving}
    verdict = checks.draft_backend_verdict(
        tested["ok"], runs.get("TRITON_MLA", {}).get("cells", []),
        runs.get("ROCM_AITER_MLA", {}).get("cells", []), config.draft_margin)
    rb.write_json(f"{folder}/summary.json", {
        "applies": True, "arch": config.machine.gcn_arch, "regime": config.sweep_regime,
        "rule": checks.DRAFT_RULE.format(margin=config.draft_margin), "test": tested,
        "runs": runs, "verdict": verdict})
    rb.say(f"  draft attention on {config.machine.gcn_arch}: {verdict['backend']} "
           f"({verdict['reason']})")
    if not tested["ok"]:
        raise StepError(f"draft attention: ROCM_AITER_MLA's non-causal decode was not shown "
                        f"to match TRITON_MLA's ({tested['failed']} failed, "
                        f"{len(tested['skipped'])} skipped, {tested['passed']} passed); see "
                        f"{folder}/summary.json and logs/{parse.slug(check.commands[0].title)}"
                        ".log")


def _draft_test(rb: Runbook) -> dict:
    run = parse.junit(rb.path(f"{plan.DRAFT_FOLDER}/junit.xml"))
    return {"ok": run.failed == 0 and not run.skipped and run.passed > 0,
            "passed": run.passed, "failed": run.failed,
            "skipped": [{"test": t, "reason": r} for t, r in run.skipped]}


def _draft_run(rb: Runbook, session: plan.Session) -> dict:
    """One draft backend's cells, and the backends its server's log names."""
    cells = []
    for command in session.commands:
        figures = parse.bench_result(rb.path(command.done[0]))
        cells.append({"concurrency": command.meta["concurrency"],
                      "output_len": command.meta["output_len"],
                      "mean_itl_ms": figures["mean_itl_ms"],
                      "mean_tpot_ms": figures["mean_tpot_ms"],
                      "output_throughput": figures["output_throughput"],
                      "acceptance_length": figures["spec_decode_acceptance_length"],
                      "file": command.done[0]})
    assert session.server is not None
    log = rb.path(f"logs/{session.server.container}.log")
    return {"speculative_config": session.server.start[session.server.start.index(
        "--speculative-config") + 1], "log_backends": parse.served_backends(log),
        "log": rb.rel(log), "cells": cells}


def report(rb: Runbook) -> None:
    from scripts.runbook.report import write_report

    folder = write_report(rb.config, rb.out)
    rb.say(f"5. report: {rb.rel(folder)}/summary.md")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the runbook: how it runs, and the sessions it plans (for
    `--dry-run` and plan.txt). A new step is one more entry of STEPS."""

    name: str
    run: Callable[[Runbook], None]
    plan: Callable[[Config], list[plan.Session]]


# The runbook's steps, in the order they run; `--steps` picks from these names.
STEPS = (
    Step("preflight", preflight, plan.preflight),
    Step("tests", tests, plan.tests),
    Step("profile", profile, plan.profile),
    Step("accuracy", accuracy, plan.accuracy),
    Step("sweep", sweep, plan.sweep),
    Step("kernels", kernels, plan.kernels),
    Step("draft-attention", draft_attention, plan.draft_attention),
    # Written from whatever the others gathered, also when one fails (cli.run).
    Step("report", report, plan.report),
)
NAMES = tuple(step.name for step in STEPS)


def chosen(config: Config) -> tuple[Step, ...]:
    """The steps `config` runs, in the runbook's order."""
    return tuple(step for step in STEPS if config.steps is None or step.name in config.steps)


def describe(config: Config) -> str:
    """The whole plan of `config`'s steps: every command, in order."""
    return plan.describe(config, [s for step in chosen(config) for s in step.plan(config)])
