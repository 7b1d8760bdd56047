"""The runbook's `vllm bench serve` command, run by this vLLM against a stand-in server.

No ROCm machine serves Kimi-K3 here, but the benchmark client is plain vLLM
code: the exact argv the runbook builds (minus `docker exec <container>`) runs
with the patched vLLM against tests/verification/fake_openai.py. That checks
vLLM 0.33.0 accepts every option, that the result file it writes parses with
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
    """The profile step's bench command against a stand-in server."""
    tmp = tmp_path_factory.mktemp("bench")
    tokenizer = word_level_tokenizer(tmp / "tokenizer")
    with FakeVllmServer(MODEL) as server:
        config = Config(MACHINES["mi300x"], tmp / "out", ROOT, model=MODEL,
                        port=server.port, input_len=32)
        (session,) = plan.profile(config)
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
