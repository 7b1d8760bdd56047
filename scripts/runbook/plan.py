"""Every command the runbook runs, built from a Config (`steps.describe` prints them for
`--dry-run`).

Each step is a list of sessions: an optional `vllm serve` container, the
commands run while it serves, then the container is stopped and its log
kept. Containers see the results folder as /runbook, so every result file a
command writes lands on the host as it arrives.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from scripts.runbook.config import CONFIG_LABELS, REGIMES, Config
from scripts.testing.testrun import vllm_test_files

IN_CONTAINER = "/runbook"  # the results folder, inside every container
STACK_IN_CONTAINER = "/k3-stack"  # the project (scripts/), read-only
TESTS_IN_CONTAINER = "/k3-tests"  # the patched tree's tests/, read-only
GPU_FLAGS = ("--device=/dev/kfd", "--device=/dev/dri", "--group-add=video",
             "--ipc=host", "--network=host", "--cap-add=SYS_PTRACE",
             "--security-opt=seccomp=unconfined", "--shm-size=16g")
# Passed by name only: the value stays in the host environment, out of logs.
PASSED_ENV = ("HF_TOKEN",)


@dataclass
class Command:
    title: str
    argv: list[str]
    timeout: float
    kind: str  # what it is, for parsing and for the recording executor in tests
    # Globs under the results folder that exist once it has succeeded; when
    # they all exist already, the command is skipped (resume).
    done: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)
    check: bool = True  # a non-zero exit ends the step


@dataclass
class Server:
    config: str  # "ref", "A", "B"
    container: str
    image: str
    start: list[str]
    port: int
    ready_timeout: float
    regime: str  # the AITER regime it serves (config.REGIMES)

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"


@dataclass
class Session:
    title: str
    commands: list[Command]
    server: Server | None = None
    note: str = ""


def _env_flags(env: dict) -> list[str]:
    flags = [f"--env={name}" for name in PASSED_ENV]
    return flags + [f"--env={k}={v}" for k, v in env.items()]


def _mounts(config: Config) -> list[str]:
    return [f"--volume={config.out_dir}:{IN_CONTAINER}",
            f"--volume={config.hf_cache}:/root/.cache/huggingface",
            f"--volume={config.project_root}:{STACK_IN_CONTAINER}:ro"]


def one_shot(config: Config, image: str, argv: list[str], env: dict | None = None,
             extra_mounts: tuple[str, ...] = (), workdir: str = IN_CONTAINER) -> list[str]:
    """`docker run --rm` of one command in `image`, on the GPUs."""
    return [config.engine, "run", "--rm", *GPU_FLAGS, *_mounts(config), *extra_mounts,
            *_env_flags(env or {}), f"--workdir={workdir}", f"--entrypoint={argv[0]}",
            image, *argv[1:]]


def server(config: Config, label: str, regime: str, *, speculative: bool = True,
           profile_dir: str | None = None, suffix: bool = True,
           draft_backend: str | None = None) -> Server:
    """`label`'s server under the AITER `regime`; its container is named after
    both (`suffix=False`: after the label alone, as the sweep's are).
    `draft_backend` replaces the speculative config's attention backend ("":
    none named)."""
    container = f"k3-runbook-{label.lower()}" + (f"-{regime}" if suffix else "") + (
        "-profile" if profile_dir else "") + (
        f"-draft-{draft_label(draft_backend).lower()}" if draft_backend is not None else "")
    serve = ["vllm", "serve", config.model, "--port", str(config.port),
             "--tensor-parallel-size", str(config.machine.tensor_parallel_size),
             "--trust-remote-code", "--seed", "0", *config.serve_args]
    if speculative:
        serve += ["--speculative-config", config.speculative_json if draft_backend is None
                  else config.speculative_json_with(draft_backend)]
    if profile_dir:
        serve += ["--profiler-config", json.dumps(
            {"profiler": "torch", "torch_profiler_dir": profile_dir,
             "torch_profiler_with_stack": False}, separators=(", ", ": "))]
    image = config.image(label)
    start = [config.engine, "run", "--detach", f"--name={container}", *GPU_FLAGS,
             *_mounts(config), *_env_flags(config.env(regime)), f"--entrypoint={serve[0]}",
             image, *serve[1:]]
    return Server(label, container, image, start, config.port, config.server_ready_timeout,
                  regime)


def in_server(config: Config, srv: Server, argv: list[str]) -> list[str]:
    return [config.engine, "exec", srv.container, *argv]


# --- the steps ---------------------------------------------------------------


def preflight(config: Config) -> list[Session]:
    probe = ["python3", "-m", "scripts.runbook.probe"]
    commands = [Command("container engine answers", [config.engine, "info"], 120, "engine")]
    for label in ("A", "B", "tests"):
        image = config.image(label)
        if label == "tests" and image == config.candidate_image:
            continue
        commands.append(Command(f"image {label} exists", [config.engine, "image", "inspect",
                                "--format={{.Id}}", image], 120, "image", meta={"config": label}))
        commands.append(Command(
            f"image {label}: versions and drafter module on this GPU",
            one_shot(config, image, probe, env={"PYTHONPATH": STACK_IN_CONTAINER}),
            900, "probe", meta={"config": label}))
    return [Session("0. preflight", commands)]


def stack_test_files(config: Config) -> list[str]:
    """The stack's vLLM test files, as `make test` counts them, from the overlay's
    manifest (what the stack adds or changes)."""
    manifest = json.loads((config.project_root / "vllm_overlay" / "MANIFEST.json").read_text())
    return vllm_test_files([e["path"] for e in manifest["files"]
                            if e["patched_sha256"] != "deleted"])


def _tests_mounts(config: Config) -> tuple[str, ...]:
    """vLLM's tests/ and pytest config from the patched tree; `vllm` itself is
    the image's installed package (the source tree is not on sys.path)."""
    tree = config.project_root / "build" / "vllm"
    return (f"--volume={tree / 'tests'}:{TESTS_IN_CONTAINER}/tests:ro",
            f"--volume={tree / 'pyproject.toml'}:{TESTS_IN_CONTAINER}/pyproject.toml:ro")


def tests(config: Config) -> list[Session]:
    mounts = _tests_mounts(config)
    argv = ["python3", "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
            f"--junitxml={IN_CONTAINER}/tests/junit.xml", *stack_test_files(config)]
    command = Command("the stack's vLLM tests in B", one_shot(
        config, config.tests_image, argv, extra_mounts=mounts, workdir=TESTS_IN_CONTAINER),
        config.tests_timeout, "pytest", done=("tests/junit.xml",), check=False)
    return [Session("1. device tests (B)", [command])]


def _bench(config: Config, srv: Server, result: str, *, concurrency: int, output_len: int,
           num_prompts: int, extra: tuple[str, ...] = ()) -> list[str]:
    folder, name = result.rsplit("/", 1)
    return in_server(config, srv, [
        "vllm", "bench", "serve", "--backend", "vllm", "--model", config.model,
        "--port", str(config.port), "--trust-remote-code", *config.dataset_args,
        "--input-len", str(config.input_len), "--output-len", str(output_len),
        "--ignore-eos", "--max-concurrency", str(concurrency),
        "--num-prompts", str(num_prompts), "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metadata", f"runbook_config={srv.config}", f"image={srv.image}",
        *extra, "--save-result", f"--result-dir={folder}", f"--result-filename={name}"])


def profile(config: Config) -> list[Session]:
    """B's decode steps under the profiler, once per AITER regime."""
    sessions = []
    for regime in config.matrix:
        folder = f"profile/{regime.name}"
        srv = server(config, "B", regime.name, profile_dir=f"{IN_CONTAINER}/{folder}/trace")
        # One request at concurrency 1: every decode step is one draft step, so
        # the trace's launches divide by the drafts the result file counts.
        bench = Command(f"profile a few decode steps of B, {regime.title}", _bench(
            config, srv, f"{IN_CONTAINER}/{folder}/bench.json", concurrency=1, output_len=64,
            num_prompts=1, extra=("--profile",)), config.bench_timeout, "profile",
            done=(f"{folder}/bench.json",), meta={"regime": regime.name})
        sessions.append(Session(f"2. profile (B): {regime.title}", [bench], srv))
    return sessions


def lm_eval_client(config: Config, srv: Server, argv: list[str]) -> list[str]:
    """lm-eval in a throwaway container next to the server (host network).

    Release images do not ship lm-eval: pip installs the pinned version into
    the container, which is removed afterwards; the image stays as it is. The
    requirement and the arguments reach the shell as positional parameters.
    """
    script = 'python3 -m pip install --quiet "$0" && exec lm_eval "$@"'
    return [config.engine, "run", "--rm", "--network=host", *_mounts(config),
            *_env_flags({"PIP_BREAK_SYSTEM_PACKAGES": "1"}), "--entrypoint=sh", srv.image,
            "-c", script, config.lm_eval_requirement, *argv]


def accuracy_runs(config: Config) -> list[tuple[str, str]]:
    """(regime, label) of every gsm8k run, the sweep's regime first: in each
    regime the target without speculative decoding (the reference) and B; A
    only in the sweep's regime, whose gate decides what the sweep measures."""
    regimes = sorted(config.matrix, key=lambda r: r.name != config.sweep_regime)
    return [(r.name, label) for r in regimes
            for label in (("ref", "A", "B") if r.name == config.sweep_regime else ("ref", "B"))]


def accuracy(config: Config) -> list[Session]:
    sessions = []
    for regime, label in accuracy_runs(config):
        srv = server(config, label, regime, speculative=label != "ref")
        model_args = ",".join([
            f"model={config.model}",
            f"base_url=http://127.0.0.1:{config.port}/v1/completions",
            f"num_concurrent={config.gsm8k_concurrency}", "max_retries=3",
            "tokenized_requests=False", "trust_remote_code=True"])
        argv = ["--model", "local-completions", "--model_args", model_args,
                "--tasks", "gsm8k", "--num_fewshot", "5", "--seed", "0", "--log_samples",
                "--output_path", f"{IN_CONTAINER}/accuracy/{regime}/{label}"]
        if config.gsm8k_limit:
            argv += ["--limit", str(config.gsm8k_limit)]
        title = REGIMES[regime].title
        command = Command(f"gsm8k on {label}, {title}", lm_eval_client(config, srv, argv),
                          config.lm_eval_timeout, "lm_eval",
                          done=(f"accuracy/{regime}/{label}/*/results_*.json",),
                          meta={"config": label, "regime": regime})
        sessions.append(Session(f"3. accuracy: {CONFIG_LABELS[label]}, {title}", [command],
                                srv))
    return sessions


def sweep(config: Config, labels: tuple[str, ...] = ("A", "B")) -> list[Session]:
    sessions = []
    for label in labels:
        srv = server(config, label, config.sweep_regime, suffix=False)
        commands = []
        for output_len in config.output_lens:
            for concurrency in config.concurrencies:
                name = f"c{concurrency}-o{output_len}.json"
                commands.append(Command(
                    f"{label}: concurrency {concurrency}, output length {output_len}",
                    _bench(config, srv, f"{IN_CONTAINER}/bench/{label}/{name}",
                           concurrency=concurrency, output_len=output_len,
                           num_prompts=max(concurrency * config.prompts_per_concurrency, 8)),
                    config.bench_timeout, "bench", done=(f"bench/{label}/{name}",),
                    meta={"config": label, "concurrency": concurrency,
                          "output_len": output_len}))
        sessions.append(Session(f"4. sweep: {CONFIG_LABELS[label]}, "
                                f"{REGIMES[config.sweep_regime].title}", commands, srv,
                                note="only if its accuracy gate passed"))
    return sessions


def report(config: Config) -> list[Session]:
    """The report runs no command: it is written from the results folder."""
    return [Session("5. report", [], note=f"write {config.out_dir}/report/ (summary.md, "
                    "CSV files, plots, commands and versions)")]


def kernels(config: Config) -> list[Session]:
    titled = [("draft-block attention kernel benchmark in B", config.kernel_bench),
              ("draft-block attention tile sweep in B", config.kernel_sweep)]
    commands = [Command(title, one_shot(config, config.candidate_image, list(argv),
                                        env={"PYTHONPATH": STACK_IN_CONTAINER},
                                        workdir=STACK_IN_CONTAINER),
                        config.bench_timeout, "kernels", check=False)
                for title, argv in titled if argv]
    return [Session("4b. kernel benchmark (B)", commands,
                    note="optional: skipped when the project has no such benchmark")]


def draft_label(backend: str | None) -> str:
    return backend or "unset"


DRAFT_FOLDER = "draft-attention"


def draft_applies(config: Config) -> bool:
    """Only gfx950 has AITER's non-causal decode: on gfx942 vLLM 0.34.0 runs
    every K3 draft on TRITON_MLA, so there is nothing to compare."""
    return config.machine.gcn_arch == "gfx950"


def draft_attention(config: Config) -> list[Session]:
    """The draft's attention: AITER's non-causal decode against TRITON_MLA's
    (a device test), then B served once per draft backend, AITER on."""
    title = "4c. draft attention (B)"
    if not draft_applies(config):
        return [Session(title, [], note="MI355X only: on gfx942 vLLM 0.34.0 runs a K3 "
                        "draft on TRITON_MLA, the only candidate")]
    regime = config.sweep_regime
    argv = ["python3", "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
            "--rootdir", TESTS_IN_CONTAINER, "-c", f"{TESTS_IN_CONTAINER}/pyproject.toml",
            f"--junitxml={IN_CONTAINER}/{DRAFT_FOLDER}/junit.xml",
            f"{STACK_IN_CONTAINER}/{config.draft_test}"]
    check = Command("AITER's non-causal draft decode against TRITON_MLA's, in B",
                    one_shot(config, config.tests_image, argv, env=config.env(regime),
                             extra_mounts=_tests_mounts(config), workdir=TESTS_IN_CONTAINER),
                    config.tests_timeout, "draft_pytest",
                    done=(f"{DRAFT_FOLDER}/junit.xml",), check=False)
    sessions = [Session(f"{title}: correctness", [check])]
    for backend in config.draft_backends:
        sessions.append(_draft_session(config, backend, title))
    return sessions


def _draft_session(config: Config, backend: str, title: str) -> Session:
    label, regime = draft_label(backend), config.sweep_regime
    srv = server(config, "B", regime, draft_backend=backend)
    commands = [Command(
        f"B, draft on {label}: concurrency {c}, output length {o}",
        _bench(config, srv, f"{IN_CONTAINER}/{DRAFT_FOLDER}/{label}/c{c}-o{o}.json",
               concurrency=c, output_len=o,
               num_prompts=max(c * config.prompts_per_concurrency, 8)),
        config.bench_timeout, "draft_bench", done=(f"{DRAFT_FOLDER}/{label}/c{c}-o{o}.json",),
        meta={"config": "B", "backend": label, "concurrency": c, "output_len": o})
        for c, o in config.draft_cells]
    return Session(f"{title}: attention_backend {label}, {REGIMES[regime].title}", commands,
                   srv)


def describe(config: Config, sessions: list[Session]) -> str:
    """The plan of `sessions`, in order: every command with its image, port and
    environment (`steps.describe` gives it the chosen steps' sessions)."""
    m = config.machine
    tests_image = ("" if config.tests_image == config.candidate_image
                   else f"\n# device tests:  {config.tests_image} (B's overlay on a test image)")
    lines = [
        f"# K3 DSpark hardware runbook: plan for {m.name} ({m.gcn_arch}, {m.gpu}, "
        f"tensor parallel {m.tensor_parallel_size})",
        f"# A (baseline):  {config.baseline_image}",
        f"# B (candidate): {config.candidate_image}{tests_image}",
        f"# target model:  {config.model}",
        f"# speculative:   {config.speculative_json}",
        f"# results:       {config.out_dir} (/runbook in the containers)",
        f"# serve options: {shlex.join(config.serve_args) or '(none added)'}",
        f"# server env:    {' '.join(f'{k}={v}' for k, v in config.serve_env.items()) or '-'}"
        f" (+ {', '.join(PASSED_ENV)} passed through by name), and per AITER regime:",
        *(f"#   {r.name}: {' '.join(f'{k}={v}' for k, v in r.env.items())}"
          + (" (tests, A/B accuracy, sweep)" if r.name == config.sweep_regime else "")
          for r in config.matrix),
    ]
    for session in sessions:
        lines += ["", f"## {session.title}"]
        if session.note:
            lines.append(f"# {session.note}")
        srv = session.server
        if srv:
            lines += [f"# server {srv.config}: image {srv.image}, port {srv.port}, "
                      f"regime {srv.regime}",
                      f"$ {config.engine} rm --force {srv.container}   # a leftover, if any",
                      f"$ {shlex.join(srv.start)}",
                      f"# wait until {srv.health_url} answers 200 "
                      f"(at most {srv.ready_timeout:.0f} s)"]
        for command in session.commands:
            lines += [f"# {command.title} (timeout {command.timeout:.0f} s)",
                      f"$ {shlex.join(command.argv)}"]
        if srv:
            lines += [f"$ {config.engine} logs {srv.container}   "
                      f"# -> logs/{srv.container}.log",
                      f"$ {config.engine} rm --force {srv.container}"]
    return "\n".join(lines) + "\n"
