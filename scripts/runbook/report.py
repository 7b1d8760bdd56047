"""The report folder: CSV files, a markdown summary with B/A ratios, plots, and
the commands and versions of the run. Built only from the result files under
the output folder, so it can be written again at any time (`--steps report`)
and shows whatever a partial run gathered."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
from pathlib import Path

from scripts.runbook import parse
from scripts.runbook.config import CONFIG_LABELS, Config

SWEEP_COLUMNS = ("config", "image", "output_len", "max_concurrency", "num_prompts",
                 "completed", "failed", "output_throughput", "total_token_throughput",
                 "request_throughput", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                 "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                 "spec_decode_acceptance_length", "spec_decode_acceptance_rate", "file")
# B/A ratios: (column, label, higher is better)
RATIOS = (("output_throughput", "output tok/s", True),
          ("mean_tpot_ms", "mean TPOT (ms)", False),
          ("spec_decode_acceptance_length", "acceptance length", True))
_CELL = re.compile(r"c(\d+)-o(\d+)\.json$")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def sweep_rows(config: Config, out: Path) -> tuple[list[dict], list[str]]:
    rows, problems = [], []
    for label in ("A", "B"):
        for path in sorted(out.glob(f"bench/{label}/c*-o*.json")):
            if not (m := _CELL.search(path.name)):
                continue
            try:
                figures = parse.bench_result(path)
            except parse.ResultError as e:
                problems.append(str(e))
                continue
            rows.append({**figures, "config": label, "image": config.image(label),
                         "max_concurrency": int(m.group(1)), "output_len": int(m.group(2)),
                         "file": str(path.relative_to(out))})
    rows.sort(key=lambda r: (r["output_len"], r["max_concurrency"], r["config"]))
    return rows, problems


def ratio_rows(rows: list[dict]) -> list[dict]:
    cells: dict[tuple[int, int], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["output_len"], r["max_concurrency"]), {})[r["config"]] = r
    out = []
    for (output_len, concurrency), pair in sorted(cells.items()):
        if set(pair) != {"A", "B"}:
            continue
        row = {"output_len": output_len, "max_concurrency": concurrency}
        for column, _, _ in RATIOS:
            a, b = pair["A"].get(column), pair["B"].get(column)
            row[f"A {column}"], row[f"B {column}"] = a, b
            row[f"B/A {column}"] = b / a if a and b is not None else None
        out.append(row)
    return out


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _plots(rows: list[dict], folder: Path, banner: str | None) -> tuple[list[str], str | None]:
    """PNG plots, or why there are none (the ROCm image may lack matplotlib)."""
    if not rows:
        return [], "no sweep results to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ("matplotlib is not installed where the report was written; "
                    "`pip install matplotlib`, then `python3 -m scripts runbook --steps report`")
    names = []
    output_lens = sorted({r["output_len"] for r in rows})
    for column, title, _ in RATIOS:
        if all(r.get(column) is None for r in rows):
            continue
        fig, axes = plt.subplots(1, len(output_lens), figsize=(4.2 * len(output_lens), 3.6),
                                 squeeze=False)
        for ax, output_len in zip(axes[0], output_lens):
            for label, style in (("A", "o--"), ("B", "s-")):
                points = sorted((r["max_concurrency"], r[column]) for r in rows
                                if r["config"] == label and r["output_len"] == output_len
                                and r.get(column) is not None)
                if points:
                    ax.plot(*zip(*points), style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"output length {output_len}")
            ax.set_xlabel("max concurrency")
            ax.grid(True, alpha=0.3)
        axes[0][0].set_ylabel(title)
        axes[0][-1].legend()
        if banner:
            fig.suptitle(banner, color="firebrick")
        fig.tight_layout()
        name = f"{column}.png"
        fig.savefig(folder / name, dpi=100, metadata={"Software": None})
        plt.close(fig)
        names.append(name)
    return names, None


def write_report(config: Config, out: Path) -> Path:
    folder = out / "report"
    folder.mkdir(parents=True, exist_ok=True)
    rows, problems = sweep_rows(config, out)
    ratios = ratio_rows(rows)
    gate = _read(out / "accuracy/gate.json")
    _write_csv(folder / "sweep.csv", rows, list(SWEEP_COLUMNS))
    if ratios:
        _write_csv(folder / "ratios.csv", ratios, list(ratios[0]))
    if gate:
        _write_csv(folder / "accuracy.csv", [
            {"regime": regime, "config": k,
             **{f"{m} exact_match": v["scores"][m] for m in parse.GSM8K_METRICS},
             **{f"{m} stderr": v["stderrs"][m] for m in parse.GSM8K_METRICS},
             "samples": v["samples"], "repetitive_fraction": v["repetitive"],
             "gate": _gate_word(entry, k)}
            for regime, entry in gate["regimes"].items() for k, v in entry["results"].items()],
            ["regime", "config", *(f"{m} exact_match" for m in parse.GSM8K_METRICS),
             *(f"{m} stderr" for m in parse.GSM8K_METRICS), "samples",
             "repetitive_fraction", "gate"])
    plots, no_plots = _plots(rows, folder, config.banner and config.banner.split(":")[0])
    for name in ("plan.txt", "commands.log", "preflight/versions.json"):
        if (out / name).exists():
            shutil.copyfile(out / name, folder / Path(name).name)
    summary = _summary(config, out, rows, ratios, gate, plots, no_plots, problems)
    (folder / "summary.md").write_text(summary)
    return folder


def _summary(config: Config, out: Path, rows, ratios, gate, plots, no_plots,
             problems) -> str:
    m = config.machine
    lines = ["# K3 DSpark drafter on ROCm: A/B runbook report", ""]
    if config.banner:
        lines += [f"> **{config.banner}**", ""]
    lines += [
        f"- machine: {m.name} ({m.gcn_arch}, {m.gpu}), tensor parallel "
        f"{m.tensor_parallel_size}",
        f"- A: `{config.baseline_image}` — {CONFIG_LABELS['A']}",
        f"- B: `{config.candidate_image}` — {CONFIG_LABELS['B']}",
        f"- target `{config.model}`, speculative config `{config.speculative_json}`",
        "- AITER regimes (each server sets all three switches): "
        + ", ".join(f"{r.name} ({r.title})" for r in config.matrix)
        + f"; the A/B accuracy gate and the sweep: {config.sweep_regime}",
        "- more server environment: " + (" ".join(
            f"`{k}={v}`" for k, v in config.serve_env.items()) or "none"),
        f"- accuracy client: `{config.lm_eval_requirement}`, installed in a throwaway "
        "container next to each server",
        "- files: `sweep.csv`, `ratios.csv`, `accuracy.csv`, `plan.txt` (the plan), "
        "`commands.log` (every command run, in order, with exit status and duration), "
        "`versions.json`", ""]
    lines += _verdicts(out, rows, ratios, gate)
    lines += _tests_section(out) + _profile_section(out) + _accuracy_section(gate)
    lines += _sweep_section(ratios, gate, plots, no_plots, problems)
    lines += _kernels_section(out) + _draft_section(out) + _versions_section(out)
    return "\n".join(lines) + "\n"


def _verdicts(out: Path, rows, ratios, gate) -> list[str]:
    tests, prof = _read(out / "tests/summary.json"), _read(out / "profile/summary.json")
    lines = ["## Verdict", ""]
    lines.append("- device tests (B): " + (
        "not run" if not tests else
        f"{'passed' if tests['ok'] else 'FAILED'}: {tests['passed']} passed, "
        f"{tests['failed']} failed, {len(tests['skipped'])} skipped"))
    lines.append("- profile (B): " + (
        "not run" if not prof else
        f"every kernel expectation met in {len(prof['regimes'])} regime(s)" if prof["ok"] else
        "FAILED: " + ", ".join(f"{c['check']} ({regime})"
                               for regime, r in prof["regimes"].items()
                               for c in r["checks"] if not c["ok"])))
    if gate:
        sweep_gates = gate["regimes"][gate["sweep_regime"]]["gates"]
        for k in ("A", "B"):
            lines.append(f"- accuracy gate {k} ({gate['sweep_regime']}): "
                         + ("passed" if sweep_gates[k]["passed"] else
                            "FAILED: no performance is reported for it"))
        others = [r for r in gate["regimes"] if r != gate["sweep_regime"]]
        if others:
            lines.append("- accuracy gate B in the other regimes: " + ", ".join(
                f"{r} {_gate_word(gate['regimes'][r], 'B')}" for r in others))
    else:
        lines.append("- accuracy: not run; no performance is reported without it")
    if draft := _read(out / "draft-attention/summary.json"):
        lines += [f"- K3 draft attention backend, {arch}: {backend}"
                  for arch, backend in _draft_backends(draft)]
    if ratios:
        parts = [f"{label} {_fmt(_geomean([r[f'B/A {c}'] for r in ratios]), 3)}"
                 for c, label, _ in RATIOS]
        lines.append(f"- B/A, geometric mean over {len(ratios)} cells: " + ", ".join(parts))
    return lines + [""]


def _tests_section(out: Path) -> list[str]:
    tests = _read(out / "tests/summary.json")
    if not tests:
        return []
    lines = ["## 1. Device tests (B)", "",
             f"{tests['passed']} passed, {tests['failed']} failed, "
             f"{len(tests['skipped'])} skipped (ROCm-only tests must run: "
             f"{len(tests['rocm_only_skipped'])} skipped).", ""]
    for s in tests["skipped"]:
        lines.append(f"- skipped `{s['test']}`: {s['reason']}")
    return lines + ([""] if tests["skipped"] else [])


def _profile_section(out: Path) -> list[str]:
    prof = _read(out / "profile/summary.json")
    if not prof:
        return []
    lines = ["## 2. Profile of B's decode steps, per AITER regime", "",
             "Kernel names are matched over the whole trace (target and draft layers). "
             "What each regime launched for the steps its flags switch (first rank's trace; "
             "name × launches):", "",
             "| regime | absorb | RoPE | KV-cache write |", "| --- | --- | --- | --- |"]
    for regime, r in prof["regimes"].items():
        cells = ["<br>".join(f"`{name}` × {count}" for name, count in
                             sorted(r["kernels"].get(role, {}).items(), key=lambda i: -i[1]))
                 or "none" for role in ("absorb", "RoPE", "KV-cache write")]
        lines.append(f"| {regime} | " + " | ".join(cells) + " |")
    for regime, r in prof["regimes"].items():
        lines += ["", f"### {regime}: `{' '.join(f'{k}={v}' for k, v in r['env'].items())}`",
                  "", f"{len(r['traces'])} rank trace(s), {_fmt(r['drafts'], 0)} draft "
                  "step(s).", "", "| check | ok | found |", "| --- | --- | --- |"]
        for c in r["checks"]:
            lines.append(f"| {c['check']} | {'yes' if c['ok'] else '**NO**'} | "
                         f"{c['detail']} |")
    return lines + [""]


def _gate_word(entry: dict, label: str) -> str:
    if label == "ref":
        return "reference"
    return "passed" if entry["gates"][label]["passed"] else "failed"


def _accuracy_section(gate) -> list[str]:
    if not gate:
        return []
    lines = ["## 3. Accuracy first: gsm8k, 5-shot (lm-eval)", "",
             f"Gate: each speculative configuration within {gate['noise_sigmas']:g} standard "
             "errors of the difference from the target without speculative decoding served "
             "in the same AITER regime, on both metrics. A broken drafter can *raise* "
             "acceptance: acceptance alone proves nothing. A is served in the sweep's "
             f"regime ({gate['sweep_regime']}) only.", "",
             "| regime | config | strict-match | flexible-extract | samples | repetitive "
             "outputs | gate |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for regime, entry in gate["regimes"].items():
        for k, v in entry["results"].items():
            cells = [f"{v['scores'][m]:.4f} ± {_fmt(v['stderrs'][m], 4)}"
                     for m in parse.GSM8K_METRICS]
            rep = "–" if v["repetitive"] is None else f"{100 * v['repetitive']:.1f}%"
            verdict = _gate_word(entry, k)
            lines.append(f"| {regime} | {k}: {CONFIG_LABELS[k]} | {' | '.join(cells)} | "
                         f"{v['samples']} | {rep} | "
                         f"{verdict if verdict != 'failed' else '**FAILED**'} |")
    lines.append("")
    for regime, entry in gate["regimes"].items():
        for k, g in entry["gates"].items():
            lines += [f"- {k} ({regime}): " + "; ".join(g["lines"])]
    return lines + [""]


def _sweep_section(ratios, gate, plots, no_plots, problems) -> list[str]:
    lines = ["## 4. Serving sweep: B against A", ""]
    if gate:
        gates = gate["regimes"][gate["sweep_regime"]]["gates"]
        failed = [k for k in ("A", "B") if not gates[k]["passed"]]
        if failed:
            lines += [f"Not measured for {', '.join(failed)}: failed the accuracy gate.", ""]
    if not ratios:
        return lines + ["No cell has results for both A and B.", ""] + \
            [f"- unreadable: {p}" for p in problems] + ([""] if problems else [])
    header = "| output len | concurrency | " + " | ".join(
        f"A {label} | B {label} | B/A" for _, label, _ in RATIOS) + " |"
    lines += ["Per cell: A, B and B/A. Throughput: higher is better; TPOT: lower is better.",
              "", header, "|" + " --- |" * (2 + 3 * len(RATIOS))]
    for r in ratios:
        cells = []
        for column, _, _ in RATIOS:
            cells += [_fmt(r[f"A {column}"]), _fmt(r[f"B {column}"]),
                      _fmt(r[f"B/A {column}"], 3)]
        lines.append(f"| {r['output_len']} | {r['max_concurrency']} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"![{name}]({name})" for name in plots] or [f"Plots: none ({no_plots})."]
    lines += [f"- unreadable: {p}" for p in problems]
    return lines + [""]


def _kernels_section(out: Path) -> list[str]:
    k = _read(out / "kernels/summary.json")
    if not k:
        return []
    lines = ["## 4b. Draft-block attention kernel benchmark (B)", "",
             f"`{' '.join(k['command'])}`", ""]
    if not k["available"]:
        return lines + [f"Skipped: {k['reason']}.", ""]
    rows = k["rows"]
    if not rows:
        lines += ["No table in its output (`kernels/output.txt`).", ""]
    else:
        columns = list(rows[0])
        lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |"
                  for r in rows] + [""]
    return lines + _best_tiles_lines(k.get("best_tiles", []))


def _best_tiles_lines(best: list[dict]) -> list[str]:
    """The tile sweep's winners against the shipped tiles (`kernels/sweep.txt`)."""
    if not best:
        return []
    lines = ["Tile sweep (`kernels/sweep.txt`, geometric mean over its shapes): if a best "
             "tile beats the shipped one by more than the noise, change "
             "`_TILES_ROCM[<arch>]` in patch 5 (`triton_mla_block_decode.py`) and run `make test`.", "",
             "| arch | KV | best tile | ms | shipped tile ms | shipped / best |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {t['arch']} | {t['kv']} | `{t['tile']}` | {t['ms']:.4f} | "
              f"{t['shipped_ms']:.4f} | {t['shipped_ms'] / t['ms']:.2f}x |" for t in best]
    return lines + [""]


_GFX942 = "gfx942 (MI300X)"
_GFX950 = "gfx950 (MI355X), AITER on"


def _draft_backends(draft: dict) -> list[tuple[str, str]]:
    """(architecture, the backend a K3 draft should use there, and why)."""
    gfx942 = ("TRITON_MLA (vLLM 0.34.0 has no AITER non-causal decode on gfx942: the "
              "only candidate)")
    if not draft["applies"]:
        return [(_GFX942, gfx942),
                (_GFX950, "not measured on this machine: run the runbook with --machine "
                          "mi355x")]
    v = draft["verdict"]
    return [(_GFX942, gfx942), (_GFX950, f"**{v['backend']}**: {v['reason']}")]


def _draft_section(out: Path) -> list[str]:
    draft = _read(out / "draft-attention/summary.json")
    if not draft:
        return []
    lines = ["## 4c. The draft's attention backend", "",
             "A K3 draft does not inherit the target's --attention-backend: with none in "
             "the speculative config, vLLM 0.34.0 picks ROCM_AITER_MLA on gfx950 with AITER "
             "on, TRITON_MLA otherwise (AMD's recipe pins TRITON_MLA).", ""]
    lines += [f"- {arch}: {backend}" for arch, backend in _draft_backends(draft)]
    if not draft["applies"]:
        return lines + [""]
    t = draft["test"]
    lines += ["", f"Rule: {draft['rule']}.", "",
              f"Device test (`draft-attention/junit.xml`, AITER's non-causal decode against "
              f"TRITON_MLA's and a torch reference): {'passed' if t['ok'] else '**FAILED**'}: "
              f"{t['passed']} passed, {t['failed']} failed, {len(t['skipped'])} skipped.", "",
              f"B served once per draft backend ({draft['regime']}); mean ITL is the time "
              "per decode step (one draft block and its verification):", "",
              "| attention_backend | backends in the server log | concurrency | output len "
              "| mean ITL (ms) | mean TPOT (ms) | output tok/s | acceptance length |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, run in draft["runs"].items():
        logged = ", ".join(run["log_backends"]) or "none found"
        lines += [f"| {label} | {logged} | {c['concurrency']} | {c['output_len']} | "
                  f"{_fmt(c['mean_itl_ms'])} | {_fmt(c['mean_tpot_ms'])} | "
                  f"{_fmt(c['output_throughput'])} | {_fmt(c['acceptance_length'])} |"
                  for c in run["cells"]]
    return lines + [""]


def _versions_section(out: Path) -> list[str]:
    versions = _read(out / "preflight/versions.json")
    if not versions:
        return []
    keys = ("image", "image_id", "vllm", "torch", "hip", "gpu", "gcn_arch", "gpu_count", "aiter",
            "pytest", "lm_eval")
    labels = [k for k in ("A", "B", "tests") if k in versions]
    lines = ["## Versions", "", "| | " + " | ".join(labels) + " |",
             "|" + " --- |" * (1 + len(labels))]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(str(versions[k].get(key)) for k in labels)
                     + " |")
    drafters = ["<br>".join(f"{k} → {v}" for k, v in (versions[label].get("drafter") or {})
                            .items()) for label in labels]
    lines.append("| K3 DSpark drafter | " + " | ".join(drafters) + " |")
    return lines + ["", "Commands: `commands.log` lists every command of the run, in "
                    "order, with its exit status and duration.", ""]
