"""`python3 -m scripts mutate`: does `make test` still catch every defect the review found?

Each mutation puts back, as a small edit of the patched code, one defect of
an earlier ROCm drafter (request.md, k3-dspark-rocm.md "What the ROCm drafter
must get right"): the stale pointer array, the fp32 k_pe, the dropped
confidence head, the identity-RoPE fused decode, the RoPE scaling mapping,
the heads per rank, the fp8_e5m2 fallback, the KV layer names. A control
renames a local variable: it must fail nothing.

For each, one at a time, a scratch copy of the project (build/mutate/<name>/:
its files, its venvs linked, a clone of build/vllm) gets the edit in the
patch that brings the code and in every later one, as a maintainer's change
to that patch would; its `make test` starts from the green results of this
project, as after a one-patch change. (The baseline's full-stack rows run once
more: its clone of build/vllm links the editable install's build outputs,
vllm/third_party/*, where build/vllm holds the folders themselves, and the
tests look at them. The mutations start from the baseline's results, and read
the trees they name from the baseline's clone, kept until the last mutation is
done.) The
report names the rows and tests
that failed (the defect is caught) and the wall time of each run, and ends
non-zero if a defect went uncaught or the control failed anything.
`--project DIR` runs another checkout's `make test` (an older version of the
tooling, to compare); `--fresh` reuses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from scripts.common import Layout, StackError, rel, say
from scripts.stack.gitrepo import TOOL_IDENTITY, commits_since, git, read_state, state_path
from scripts.testing.prefixes import link_build_outputs
from scripts.testing.testcache import RESULTS, project_files

FOLDER = "mutate"
AMD = "vllm/models/kimi_k3/amd/dspark_mla.py"
COMMON = "vllm/models/kimi_k3/common/dspark_mla.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    defect: str  # what the review found, in short
    path: str  # in the vLLM tree
    old: str  # the patched code...
    new: str  # ...and the defect; every occurrence in the file is replaced
    control: bool = False  # changes no behaviour: must fail nothing


MUTATIONS = (
    Mutation("stale-pointers", "the context-KV pointer array is built once, never refreshed "
             "when the caches move", COMMON,
             'if getattr(self, "_kv_cache_ptrs_key", None) != key:',
             'if getattr(self, "_kv_cache_ptrs_key", None) is None:'),
    Mutation("fp32-k-pe", "DeepSeek-scaling RoPE hands back fp32 k_pe for bf16 input",
             "vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py",
             "key_rot = (key_rot * cos + rotate_fn(key_rot) * sin).to(key.dtype)",
             "key_rot = key_rot * cos + rotate_fn(key_rot) * sin"),
    Mutation("confidence-head-dropped", "the weight mapper drops the trained confidence "
             "head's weights", COMMON,
             'orig_to_new_substr={"confidence_head": "confidence_head"}',
             'orig_to_new_substr={"confidence_head": None}'),
    Mutation("fused-decode-guard", "the wrapper's identity-RoPE fused decode runs for the "
             "drafter", "vllm/models/kimi_k3/amd/mla.py",
             "        if self.rotary_emb is not None:\n            return False\n", ""),
    Mutation("rope-scaling-mapping", "attention_factor 1.0 maps to YaRN, other factors to "
             "llama scaling", "vllm/models/kimi_k3/common/mla_rope.py",
             'if rope_parameters.get("attention_factor") == 1.0',
             'if rope_parameters.get("attention_factor") != 1.0'),
    Mutation("heads-per-rank", "the wrapper takes the global head count, not the rank's",
             AMD, "num_heads=num_heads // tp_size,", "num_heads=num_heads,"),
    Mutation("fp8-e5m2-fallback", "the grouped insert is used for fp8_e5m2 on ROCm, which "
             "0.34.0's kernel rejects", AMD,
             'grouped_kv_cache_dtypes = K3DSparkModelBase.grouped_kv_cache_dtypes - {"fp8_e5m2"}',
             "grouped_kv_cache_dtypes = K3DSparkModelBase.grouped_kv_cache_dtypes"),
    Mutation("wrapper-kv-names", "the speculator gets the wrapper's layer names, not the "
             "inner attention's", AMD,
             "class K3DSparkForCausalLM(K3DSparkForCausalLMBase):\n"
             "    model_cls = K3DSparkModel\n",
             "class K3DSparkForCausalLM(K3DSparkForCausalLMBase):\n"
             "    model_cls = K3DSparkModel\n\n"
             "    def get_draft_kv_cache_layer_names(self) -> list[str]:\n"
             "        layers = self.model._kv_cache_layers()\n"
             '        return [cl.layer_name.removesuffix(".attn") for cl in layers]\n'),
    # Patch 2's local (a one-patch change to patch 2, as before the port).
    Mutation("control-rename", "none: a local variable renamed", COMMON,
             "grouped_dtypes", "all_layers_grouped", control=True),
)


def mutate(layout: Layout, names: list[str], project: Path | None = None,
           fresh: bool = False) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    if unknown := sorted(set(names) - {m.name for m in MUTATIONS}):
        raise StackError(f"unknown mutation(s) {', '.join(unknown)}; known: "
                         + ", ".join(m.name for m in MUTATIONS))
    source = (project or layout.root).resolve()
    folder = layout.build_dir / FOLDER
    _check_each_applies(layout, chosen)
    say(f"mutate: {len(chosen)} mutation(s) of {rel(layout.tree, layout)}, each tested by the "
        f"`make test` of {source}" + (" (FRESH)" if fresh else ""))
    # First the stack as it is: it must pass, and its results are what each
    # mutation's run starts from (the project's own, if they are current).
    baseline = _one(layout, source, folder, None, layout.build_dir / RESULTS, fresh)
    if baseline["exit"] != 0:
        raise StackError(f"the stack as it is fails make test in {rel(folder, layout)}/baseline "
                         "(see its build/make-test.log): fix that before asking what catches a defect")
    results = [_one(layout, source, folder, m, folder / "baseline" / "build" / RESULTS, fresh)
               for m in chosen]
    _remove_scratch(folder / "baseline", keep=_kept(folder / "baseline"))
    _write_report(folder, source, baseline, results)
    return _print(results)


def _check_each_applies(layout: Layout, chosen: list[Mutation]) -> None:
    """Refuse, before any run, a mutation whose code no patch has any more: found
    after the baseline and the other mutations, it would cost their hours."""
    commits = commits_since(layout.tree, read_state(layout.tree)["base_tag"])
    for mutation in chosen:
        if not any(mutation.old in git(layout.tree, "show", f"{commit}:{mutation.path}",
                                       check=False).stdout for commit in commits):
            raise _stale(mutation)


def _stale(mutation: Mutation) -> StackError:
    return StackError(f"mutation {mutation.name}: no patch has {mutation.old.strip()!r} in "
                      f"{mutation.path}; the stack changed: update scripts/testing/mutate.py")


def _one(layout: Layout, source: Path, folder: Path, mutation: Mutation | None,
         start_from: Path, fresh: bool) -> dict:
    name = mutation.name if mutation else "baseline"
    scratch = folder / name
    if scratch.exists():
        _remove_scratch(scratch)
    say(f"\n=== {name}: {mutation.defect if mutation else 'the stack as it is'}")
    changed = _scratch_project(layout, source, scratch, mutation, start_from)
    if mutation:
        say(f"  {mutation.path} changed in patch(es) {', '.join(map(str, changed))}")
    start = time.monotonic()
    # The scratch project's own `make test`, so that its commands see the
    # environment the project's greens were recorded in (every variable is in
    # every key; make exports its own, empty ones among them), and nothing
    # else: no PYTHONPATH (`-m scripts` imports the scratch's scripts/, the
    # folder it runs in) and no K3_CACHE_DIR (the scratch's .cache is a link
    # to the project's cache). `-o build` keeps make from re-applying the
    # patches over the mutated stack and from rebuilding the linked venvs.
    env = {**os.environ, "K3_PROJECT_ROOT": str(scratch)}
    command = ["make", "--no-print-directory", "-o", "build", "test",
               f"FRESH={1 if fresh else ''}", "ONLY="]
    # In the scratch project's build/, like its results: a file at its top would be
    # one of the project's files, an input of every key.
    log_path, _ = _kept(scratch)
    tree = scratch / "build" / "vllm"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        code = subprocess.run(command, cwd=scratch, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    caught = _failures(scratch)
    say(f"  make test in {rel(scratch, layout)} exited {code} after {seconds:.0f} s; "
        + (f"failed: {', '.join(sorted(caught))}" if caught else "nothing failed"))
    # The baseline's clone stays until the mutations are done: its green records
    # name the trees it wrote into its own object store.
    _remove_scratch(scratch, keep=_kept(scratch) + ((tree,) if mutation is None else ()))
    return {"name": name, "defect": mutation.defect if mutation else "",
            "control": mutation.control if mutation else True, "patches": changed,
            "exit": code, "seconds": round(seconds), "caught": caught}


def _kept(scratch: Path) -> tuple[Path, Path]:
    """What a scratch project keeps when its run is over: its log, its results."""
    return scratch / "build" / "make-test.log", scratch / "build" / RESULTS


def _scratch_project(layout: Layout, source: Path, scratch: Path, mutation: Mutation | None,
                     start_from: Path) -> list[int]:
    """The project's files, its venvs, build/vllm with the mutation in each patch that
    has the code, and the green results in `start_from`. Returns those patches' numbers."""
    for relpath in project_files(source):
        target = scratch / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        if (source / relpath).is_file() or (source / relpath).is_symlink():
            shutil.copy2(source / relpath, target, follow_symlinks=False)
    for venv in (layout.venv, layout.lint_venv):
        (scratch / venv.name).symlink_to(venv.resolve())
    if "K3_CACHE_DIR" not in os.environ:
        # The downloads the project's run used (pinned and hash-checked), found
        # where its make test finds them: in the project's .cache/.
        (scratch / ".cache").symlink_to(layout.cache_dir.resolve())
    tree = scratch / "build" / "vllm"
    tree.parent.mkdir(parents=True, exist_ok=True)
    git(layout.tree, "clone", "--quiet", "--shared", "--no-checkout", str(layout.tree),
        str(tree))
    baseline_objects = scratch.parent / "baseline" / "build" / "vllm" / ".git" / "objects"
    if mutation is not None and baseline_objects.is_dir():
        # The trees of the baseline's records (their build outputs linked in) are
        # objects of its clone: without them a mutation's rows could not compare
        # their tree with the baseline's and narrow down to the tests it reaches.
        with open(tree / ".git" / "objects" / "info" / "alternates", "a") as alternates:
            alternates.write(f"{baseline_objects.resolve()}\n")
    changed = _mutated_stack(layout, tree, mutation)
    link_build_outputs(layout.tree, tree)
    if start_from.is_dir():
        shutil.copytree(start_from, scratch / "build" / RESULTS, symlinks=True,
                        ignore=shutil.ignore_patterns("logs", "summary.json", "runs.jsonl"))
    return changed


def _mutated_stack(layout: Layout, tree: Path, mutation: Mutation | None) -> list[int]:
    """Branch `stack` of the clone, each commit with the mutation applied wherever
    its file holds the patched code (no mutation: the stack as it is)."""
    state = read_state(layout.tree)
    base = state["base_tag"]
    parent = git(tree, "rev-parse", base).stdout.strip()
    changed = []
    previous: str | None = None  # the file as the commit before had it
    index = {"GIT_INDEX_FILE": str(tree / ".git" / "mutate-index")}
    for k, commit in enumerate(commits_since(layout.tree, base), start=1):
        git(tree, "read-tree", commit, env=index)
        if mutation is None:
            parent = commit
            continue
        blob = git(tree, "show", f"{commit}:{mutation.path}", check=False)
        if blob.returncode == 0 and mutation.old in blob.stdout:
            new = git(tree, "hash-object", "-w", "--stdin",
                      input=blob.stdout.replace(mutation.old, mutation.new)).stdout.strip()
            mode = git(tree, "ls-tree", commit, "--", mutation.path).stdout.split()[0]
            git(tree, "update-index", "--cacheinfo", f"{mode},{new},{mutation.path}", env=index)
            if blob.stdout != previous:  # this patch brings (or changes) the code
                changed.append(k)
        previous = blob.stdout if blob.returncode == 0 else None
        new_tree = git(tree, "write-tree", env=index).stdout.strip()
        message = git(tree, "log", "-1", "--format=%B", commit).stdout
        dates = git(tree, "log", "-1", "--format=%ad%n%an%n%ae", "--date=raw", commit).stdout
        date, name, email = dates.splitlines()[:3]
        parent = git(tree, "commit-tree", new_tree, "-p", parent, "-F", "-", input=message,
                     env={**TOOL_IDENTITY, "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
                          "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}).stdout.strip()
    (tree / ".git" / "mutate-index").unlink(missing_ok=True)
    if mutation and not changed:
        raise _stale(mutation)
    git(tree, "checkout", "--quiet", "-B", "stack", parent)
    state_path(tree).write_text(json.dumps({**state, "applied_head": parent}, indent=1))
    return changed


def _failures(scratch: Path) -> dict[str, list[str]]:
    """Row -> failing tests (or failing commands without a test) of the scratch run."""
    results = scratch / "build" / RESULTS
    try:
        summary = json.loads((results / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"make test": ["no summary.json: it did not finish (see build/make-test.log)"]}
    caught: dict[str, list[str]] = {}
    for row in summary["rows"]:
        if not row["failed"]:
            continue
        tests = []
        for xml in _junit_files(results, row["name"]):
            for case in ET.parse(xml).getroot().iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    tests.append(f"{case.get('classname')}::{case.get('name')}")
        failing = [p for p in row["parts"] if p["failed"]]
        caught[row["name"]] = sorted(set(tests)) or [p["command"] for p in failing]
    return caught


def _junit_files(results: Path, row: str) -> list[Path]:
    """The junit files a row wrote: one per command (this tooling), or one per row."""
    from scripts.testing.testrun import _slug

    per_command = sorted((results / "logs" / _slug(row)).glob("*.xml"))
    legacy = results / f"{row.replace(' ', '-').replace('/', '-of-')}.xml"
    return per_command or ([legacy] if legacy.exists() else [])


def _remove_scratch(scratch: Path, keep: tuple[Path, ...] = ()) -> None:
    """Remove what a scratch project holds but what `keep` names (its log, results)."""
    for item in sorted(scratch.iterdir()):
        if item.name == "build" and keep:
            for inner in sorted(item.iterdir()):
                if inner not in keep:
                    _delete(inner)
        elif item not in keep:
            _delete(item)


def _delete(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def _write_report(folder: Path, source: Path, baseline: dict, results: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(
        {"project": str(source), "baseline": baseline, "mutations": results}, indent=1) + "\n")


def _print(results: list[dict]) -> int:
    say("\n=== mutations")
    bad = 0
    for r in results:
        ok = (not r["caught"]) if r["control"] else bool(r["caught"])
        bad += not ok
        verdict = ("ok: fails nothing" if r["control"] and ok else
                   "CONTROL FAILED" if r["control"] else
                   "caught" if ok else "NOT CAUGHT")
        say(f"  {r['name']:<24} {verdict:<14} {r['seconds']:>5} s  patches "
            f"{','.join(map(str, r['patches']))}")
        for row, tests in r["caught"].items():
            say(f"      {row}: {', '.join(tests[:4])}"
                + (f" and {len(tests) - 4} more" if len(tests) > 4 else ""))
    say(f"{len(results) - bad} of {len(results)} as expected; report: build/{FOLDER}/report.json")
    return 1 if bad else 0
