"""Readers of what the tools write: bench result JSON, lm-eval results, junit, traces.

Each reader takes a file and returns plain values, or raises ResultError with
one line naming the file and what is wrong with it.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


class ResultError(Exception):
    """A result file that is missing or not what its tool writes."""


def _load_json(path: Path) -> dict:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ResultError(f"{path}: missing")
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise ResultError(f"{path}: not valid JSON ({e})")
    if not isinstance(data, dict):
        raise ResultError(f"{path}: expected a JSON object")
    return data


def _number(data: dict, key: str, path: Path, *, required: bool = True) -> float | int | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ResultError(f"{path}: {key!r} is {value!r}, not a number "
                          "(is this a `vllm bench serve --save-result` file?)")
    return value


# --- vllm bench serve --save-result ------------------------------------------

# Keys of vLLM 0.34.0's result JSON (vllm/benchmarks/serve.py) the report uses.
BENCH_KEYS = ("completed", "failed", "num_prompts", "max_concurrency", "duration",
              "request_throughput", "output_throughput", "total_token_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms")
# Present when the server reports speculative decoding (its /metrics).
SPEC_KEYS = ("spec_decode_acceptance_length", "spec_decode_acceptance_rate",
             "spec_decode_num_drafts", "spec_decode_draft_tokens",
             "spec_decode_accepted_tokens")


def bench_result(path: Path) -> dict:
    """The figures of one `vllm bench serve` result file."""
    data = _load_json(path)
    row = {key: _number(data, key, path) for key in BENCH_KEYS}
    for key in SPEC_KEYS:
        row[key] = _number(data, key, path, required=False)
    if row["completed"] == 0:
        raise ResultError(f"{path}: no request completed ({int(row['failed'] or 0)} failed)")
    row["model_id"] = data.get("model_id")
    return row


# --- lm-eval --output_path ----------------------------------------------------

GSM8K_METRICS = ("strict-match", "flexible-extract")


@dataclass
class Accuracy:
    config: str
    scores: dict[str, float]  # filter -> exact match
    stderrs: dict[str, float | None]
    samples: int
    file: Path


def latest_lm_eval_results(folder: Path) -> Path:
    """lm-eval writes <output_path>/<model>/results_<timestamp>.json; the newest one."""
    found = sorted(folder.glob("*/results_*.json"))
    if not found:
        raise ResultError(f"{folder}: no lm-eval results_*.json in it")
    return found[-1]


def lm_eval_gsm8k(config: str, path: Path) -> Accuracy:
    data = _load_json(path)
    task = data.get("results", {}).get("gsm8k")
    if not isinstance(task, dict):
        raise ResultError(f"{path}: no results.gsm8k (is this an lm-eval results file?)")
    scores, stderrs = {}, {}
    for name in GSM8K_METRICS:
        scores[name] = _number(task, f"exact_match,{name}", path)
        stderr = task.get(f"exact_match_stderr,{name}")
        stderrs[name] = float(stderr) if isinstance(stderr, (int, float)) else None  # "N/A"
    n = data.get("n-samples", {}).get("gsm8k", {}).get("effective") or task.get("sample_len")
    if not isinstance(n, int) or n <= 0:
        raise ResultError(f"{path}: no sample count for gsm8k (n-samples.gsm8k.effective)")
    return Accuracy(config, scores, stderrs, n, path)


REPEAT_NGRAM = 8  # words
REPEAT_TIMES = 4


def repetitive_fraction(samples_file: Path) -> float | None:
    """Share of responses in which some 8-word sequence recurs 4 times or more:
    the symptom of the corrupted drafter (repetitive target output)."""
    if not samples_file.exists():
        return None
    total = repetitive = 0
    for line in samples_file.read_text(errors="replace").splitlines():
        try:
            sample = json.loads(line)
        except json.JSONDecodeError:
            continue
        responses = sample.get("resps") or []
        text = " ".join(str(r[0] if isinstance(r, list) and r else r) for r in responses)
        words = text.split()
        counts: dict[tuple[str, ...], int] = {}
        for i in range(len(words) - REPEAT_NGRAM + 1):
            gram = tuple(words[i:i + REPEAT_NGRAM])
            counts[gram] = counts.get(gram, 0) + 1
        total += 1
        repetitive += bool(counts) and max(counts.values()) >= REPEAT_TIMES
    return repetitive / total if total else None


# --- pytest --junitxml --------------------------------------------------------


@dataclass
class TestRun:
    passed: int
    failed: int
    skipped: list[tuple[str, str]]  # (test id, reason)


def junit(path: Path) -> TestRun:
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise ResultError(f"{path}: missing (pytest did not get to write it)")
    except ET.ParseError as e:
        raise ResultError(f"{path}: not valid junit XML ({e})")
    passed = failed = 0
    skipped = []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if (skip := case.find("skipped")) is not None:
            skipped.append((test_id, skip.get("message", "")))
        elif case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        else:
            passed += 1
    return TestRun(passed, failed, skipped)


# --- torch profiler chrome trace ----------------------------------------------


@dataclass
class Trace:
    kernels: list[str]  # GPU kernel names, one per launch
    runtime: list[str]  # HIP/CUDA runtime calls
    cpu_ops: list[str]


def chrome_trace(path: Path) -> Trace:
    """Names from a torch profiler trace (.pt.trace.json, gzipped or not)."""
    data = _load_json(path)
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise ResultError(f"{path}: no traceEvents list (is this a torch profiler trace?)")
    trace = Trace([], [], [])
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        category, name = str(event.get("cat", "")).lower(), str(event.get("name", ""))
        if category == "kernel":
            trace.kernels.append(name)
        elif "runtime" in category or "driver" in category:
            trace.runtime.append(name)
        elif category == "cpu_op":
            trace.cpu_ops.append(name)
    return trace


# --- the kernel benchmark (another tool's output: read leniently) ------------


def kernel_table(text: str) -> list[dict]:
    """Rows from the benchmark's output: a JSON list/object of rows, else CSV lines."""
    for candidate in (text.strip(), *reversed(text.strip().splitlines())):
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict):
            data = next((v for v in data.values() if isinstance(v, list)), [data])
        if isinstance(data, list) and all(isinstance(r, dict) for r in data) and data:
            return data
    lines = [ln for ln in text.splitlines() if ln.count(",") >= 1 and not ln.startswith("#")]
    if len(lines) >= 2:
        rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
        width = len(rows[0]) if rows else 0
        if rows and all(len(r) == width and None not in r for r in rows):
            return rows
    return []


_BEST_TILE = re.compile(r"^best tile (?P<arch>\S+) (?P<kv>\S+): (?P<tile>_MLABlockTile\(.*\)) "
                        r"(?P<ms>[0-9.]+) ms .*shipped tile (?P<shipped_ms>[0-9.]+) ms")


def best_tiles(text: str) -> list[dict]:
    """The sweep's `best tile <arch> <kv>: _MLABlockTile(...) <ms> ms (...; shipped
    tile <ms> ms)` lines, one per KV dtype."""
    found = []
    for line in text.splitlines():
        if m := _BEST_TILE.match(line.strip()):
            found.append({**m.groupdict(), "ms": float(m["ms"]),
                          "shipped_ms": float(m["shipped_ms"])})
    return found


# --- vllm serve's log: the attention backends it chose ----------------------

# platforms/rocm.py (0.34.0): "Using X backend (selected via ...)", "Using X
# backend out of potential backends: ...", "... Overriding with X out of ...".
_BACKEND_CHOSEN = re.compile(r"(?:Using|Overriding with) ([A-Z][A-Z0-9_]*) (?:backend|out of)")


def served_backends(log: Path) -> list[str]:
    """The attention backends a server's log says were chosen (target and draft
    layers alike: vLLM logs each choice once), in order; none if no log."""
    if not log.exists():
        return []
    found = _BACKEND_CHOSEN.findall(log.read_text(errors="replace"))
    return list(dict.fromkeys(found))


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower()
