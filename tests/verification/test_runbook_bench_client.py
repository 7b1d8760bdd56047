"""The runbook's `vllm bench serve` command, run by this vLLM against a stand-in server.

No ROCm machine serves Kimi-K3 here, but the benchmark client is plain vLLM
code: the exact argv the runbook builds (minus `docker exec <container>`) runs
with the patched vLLM against tests/verification/fake_openai.py. That checks
vLLM 0.34.0 accepts every option, that the result file it writes parses with
the runbook's reader, that acceptance lengths come from the server's
spec-decode counters, and that the recorded sample the runbook's tests use
(tests/tooling/runbook_samples/) has exactly the keys vLLM writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.runbook import parse, plan
from scripts.runbook.config import MACHINES, Config
from tests.verification.fake_openai import FakeVllmServer, word_level_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "tooling" / "runbook_samples" / "bench_serve_result.json"
MODEL = "fake-org/Kimi-K3"


def run_client(argv: list[str], config: Config, tokenizer: Path) -> subprocess.CompletedProcess:
    engine, verb, container, executable, *client = argv
    assert (engine, verb, executable) == ("docker", "exec", "vllm")
    # Results go to the host folder the container's /runbook is mounted from.
    client = [a.replace(f"={plan.IN_CONTAINER}", f"={config.out_dir}") for a in client]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *client,
                           "--tokenizer", str(tokenizer)],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The profile step's bench command (the sweep's AITER regime) against a
    stand-in server."""
    tmp = tmp_path_factory.mktemp("bench")
    tokenizer = word_level_tokenizer(tmp / "tokenizer")
    with FakeVllmServer(MODEL) as server:
        config = Config(MACHINES["mi300x"], tmp / "out", ROOT, model=MODEL,
                        port=server.port, input_len=32)
        (session,) = [s for s in plan.profile(config) if s.server.regime == config.sweep_regime]
        (command,) = session.commands
        result = run_client(command.argv, config, tokenizer)
    return config, command, server, result


def test_vllm_accepts_the_runbook_bench_command(profiled):
    config, command, server, result = profiled
    assert result.returncode == 0, result.stderr[-3000:]
    assert "POST /start_profile" in server.calls and "POST /stop_profile" in server.calls


def test_its_result_file_parses_with_acceptance_from_the_server_metrics(profiled):
    config, command, server, result = profiled
    (done,) = command.done
    figures = parse.bench_result(config.out_dir / done)
    assert figures["completed"] == 1 and figures["max_concurrency"] == 1
    assert figures["output_throughput"] > 0 and figures["mean_tpot_ms"] > 0
    assert figures["spec_decode_num_drafts"] == server.drafts
    assert figures["spec_decode_acceptance_length"] == pytest.approx(
        1 + server.accepted / server.drafts)
    data = json.loads((config.out_dir / done).read_text())
    assert data["runbook_config"] == "B" and data["image"] == config.candidate_image


def test_the_recorded_sample_has_exactly_the_keys_vllm_writes(profiled):
    config, command, server, result = profiled
    written = json.loads((config.out_dir / command.done[0]).read_text())
    sample = json.loads(SAMPLE.read_text())
    assert sorted(sample) == sorted(written)



SERVE_CHECK = """
import dataclasses, json, sys, typing
from tests.verification.harness import platform
platform.activate("rocm-gfx950")  # parse as on an MI355X
from vllm.config.speculative import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
subcommand = ServeSubcommand()
subcommand.subparser_init(parser.add_subparsers(dest="subparser"))
fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
out = []
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv)
    subcommand.validate(args)
    args.model = args.model_tag
    engine = EngineArgs.from_cli_args(args)
    spec = engine.speculative_config or {}
    out.append({
        "model": args.model_tag, "tp": engine.tensor_parallel_size, "port": args.port,
        "spec": spec, "unknown": sorted(set(spec) - set(fields)),
        "invalid": {k: v for k, v in spec.items() if k in fields
                    and typing.get_origin(fields[k].type) is typing.Literal
                    and v not in typing.get_args(fields[k].type)},
        "profiler": engine.profiler_config.profiler,
        "profiler_dir": engine.profiler_config.torch_profiler_dir})
print("RESULT " + json.dumps(out))
"""


def test_vllm_parses_the_runbook_serve_commands():
    """Every `vllm serve` the runbook starts parses with this vLLM's own CLI and
    engine arguments, and the speculative config's keys and choices are
    SpeculativeConfig's."""
    config = Config(MACHINES["mi355x"], Path("/results"), ROOT)
    servers = [s.server for step in (plan.profile, plan.accuracy, plan.sweep)
               for s in step(config)]
    argvs = [srv.start[srv.start.index(srv.image) + 1:] for srv in servers]
    assert all(a[:2] == ["serve", config.model] for a in argvs)
    # Not HF_HUB_OFFLINE: offline, EngineArgs looks the model up in the local cache.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run([sys.executable, "-c", SERVE_CHECK, json.dumps(argvs)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    parsed = json.loads(lines[-1][len("RESULT "):])
    for srv, result in zip(servers, parsed):
        assert result["model"] == config.model and result["tp"] == 8
        assert result["port"] == config.port
        if srv.config == "ref":
            assert result["spec"] == {}
        else:
            assert result["spec"] == config.speculative_config
        assert result["unknown"] == [] and result["invalid"] == {}
    # One profiled server per AITER regime, each writing its own trace folder.
    profiles = [(srv.regime, result["profiler"], result["profiler_dir"])
                for srv, result in zip(servers, parsed) if result["profiler"]]
    assert profiles == [(r.name, "torch", f"/runbook/profile/{r.name}/trace")
                        for r in config.matrix]
