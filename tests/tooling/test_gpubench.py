"""`make gpubench` builds a package of each tree's kernel files with stand-ins for
vLLM's heavy modules; its runner summarizes and tabulates the timings.

No GPU here: the tests build packages from a fake release and a patch, import
and run their trees' kernels in Triton's interpreter, and check the table and
ratio logic on made-up timings.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.tooling.conftest import PYTHON, REPO, V1, release_files, snapshot

RUNNER = REPO / "benchmarks" / "gpu"

# vllm/kernels/add.py imports a helper module, the two stand-in modules, and
# (only for type checking, or lazily) vllm.config, which must stay out.
ADD = '''\
from typing import TYPE_CHECKING

import torch

from vllm.kernels.helpers import BLOCK
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@triton.jit
def _add_kernel(x_ptr, out_ptr, n, SHIFT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + SHIFT, mask=mask)


def add(x):
    out = torch.empty_like(x)
    shift = 1 if current_platform.is_rocm() else BLOCK
    _add_kernel[(triton.cdiv(x.numel(), 8),)](x, out, x.numel(), shift, BLOCK_SIZE=8)
    return out


def config():
    from vllm.config import VllmConfig

    return VllmConfig()
'''
HEAVY = "import vllm.envs\n"
KERNEL_FILES = {
    "vllm/kernels/__init__.py": HEAVY,  # a package __init__ that must not be copied
    "vllm/kernels/add.py": ADD,
    "vllm/kernels/helpers.py": "BLOCK = 16\n",
    "vllm/config.py": HEAVY,
    "vllm/envs.py": "import os\n",
    "vllm/triton_utils/__init__.py": HEAVY + "import triton\n",
    "vllm/platforms/__init__.py": HEAVY + "current_platform = None\n",
}
CASE = '''\
"""A case of the tests: vllm/kernels/add.py."""
FILES = ("vllm/kernels/add.py",)
SHAPES = ({"name": "8 elements", "n": 8},)


def make_inputs(shape, device, generator):
    import torch

    return torch.arange(shape["n"], device=device)


def bind(load):
    return load("vllm.kernels.add").add
'''


@pytest.fixture
def bench_project(project):
    """A project whose release has a kernel file; one patch changes its helper."""
    project.use_release(V1, files={**release_files(V1),
                                   **{k: v.encode() for k, v in KERNEL_FILES.items()}})
    project.ok("apply")
    project.commit("[Kernel] Shift by 32", {"vllm/kernels/helpers.py": "BLOCK = 32\n"})
    runner = project.root / "benchmarks" / "gpu"
    (runner / "cases").mkdir(parents=True)
    for name in ("run.py", "stats.py", "timing.py"):
        shutil.copy2(RUNNER / name, runner / name)
    (runner / "cases" / "add.py").write_text(CASE)
    return project


def build(project, *args):
    return project.run("gpubench", "--build-only", *args)


def package_of(project) -> Path:
    return project.root / "build" / "gpubench"


def test_package_holds_each_tree_with_the_stand_ins(bench_project):
    result = build(bench_project)
    assert result.returncode == 0, result.stderr
    package = package_of(bench_project)
    assert "built build/gpubench" in result.stdout
    manifest = json.loads((package / "trees.json").read_text())
    assert manifest["cases"] == ["add"]
    assert [(t["label"], t["rev"]) for t in manifest["trees"]] == [
        ("pristine", f"vllm-{V1}"), ("patched", "HEAD")]
    assert manifest["trees"][1]["commit"] == bench_project.head()
    for tree, block in (("pristine", "16"), ("patched", "32")):
        vllm = package / "trees" / tree / "vllm"
        files = sorted(p.relative_to(vllm).as_posix() for p in vllm.rglob("*.py"))
        # The entry file and its helper; empty package markers; the stand-ins.
        # Neither vllm.config (type checking, lazy) nor vllm.envs (the real
        # triton_utils and platforms) nor the real package __init__.
        assert files == ["__init__.py", "distributed/__init__.py",
                         "distributed/parallel_state/__init__.py", "kernels/__init__.py",
                         "kernels/add.py", "kernels/helpers.py", "platforms/__init__.py",
                         "platforms/rocm/__init__.py", "triton_utils/__init__.py",
                         "utils/__init__.py", "utils/mem_utils/__init__.py", "v1/__init__.py",
                         "v1/worker/__init__.py", "v1/worker/gpu/__init__.py",
                         "v1/worker/gpu/input_batch/__init__.py",
                         "v1/worker/gpu/sample/__init__.py",
                         "v1/worker/gpu/sample/batch_shard/__init__.py"]
        assert (vllm / "kernels" / "add.py").read_text() == ADD
        assert (vllm / "kernels" / "helpers.py").read_text() == f"BLOCK = {block}\n"
        assert (vllm / "kernels" / "__init__.py").read_text() == ""
        standin = (vllm / "triton_utils" / "__init__.py").read_text()
        assert "HAS_TRITON = True" in standin and "libdevice as tldevice" in standin
        assert "envs" not in standin
        assert "def is_rocm" in (vllm / "platforms" / "__init__.py").read_text()
    for name in ("run.py", "stats.py", "timing.py", "cases/add.py"):
        assert (package / name).read_bytes() == (
            bench_project.root / "benchmarks" / "gpu" / name).read_bytes()


def test_more_trees_by_revision_and_another_source(bench_project, tmp_path):
    source = tmp_path / "other-vllm"
    subprocess.run(["git", "clone", "-q", str(bench_project.tree), str(source)], check=True)
    bench_project.git("commit", "-q", "--allow-empty", "-m", "later", cwd=source)
    package = tmp_path / "pkg"
    result = build(bench_project, "--source", source, "--package", package,
                   "--rev", "before=HEAD~1", "--case", "add")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((package / "trees.json").read_text())
    assert [t["label"] for t in manifest["trees"]] == ["pristine", "patched", "before"]
    assert manifest["trees"][2]["commit"] == bench_project.head()
    helpers = package / "trees" / "before" / "vllm" / "kernels" / "helpers.py"
    assert helpers.read_text() == "BLOCK = 32\n"
    assert not package_of(bench_project).exists()


def _land(project, subject: str) -> str:
    """Export build/vllm to patches/ and commit them in the project (a landing)."""
    project.ok("patches")
    project.git("add", "patches", "pin.toml", cwd=project.root)
    project.git("commit", "-q", "-m", subject, cwd=project.root)
    return project.git("rev-parse", "HEAD", cwd=project.root)


def _helpers(package: Path, tree: str) -> str:
    return (package / "trees" / tree / "vllm" / "kernels" / "helpers.py").read_text()


def test_before_is_the_previous_landed_revision_of_the_timed_files(bench_project):
    """Every package carries `before`: the newest landed stack whose timed
    files differ from patched's, rebuilt from the project's history (the
    working stack may be ahead of it, or equal to what landed last)."""
    bench_project.git("init", "-q", cwd=bench_project.root)
    first = _land(bench_project, "Stack: shift by 32")
    bench_project.commit("[Kernel] Shift by 64", {"vllm/kernels/helpers.py": "BLOCK = 64\n"})
    package = package_of(bench_project)

    result = build(bench_project)  # the stack is ahead of what landed
    assert result.returncode == 0, result.stderr
    manifest = json.loads((package / "trees.json").read_text())
    assert [(t["label"], t["rev"]) for t in manifest["trees"]] == [
        ("pristine", f"vllm-{V1}"), ("before", f"project {first[:9]}"), ("patched", "HEAD")]
    assert (_helpers(package, "before"), _helpers(package, "patched")) == (
        "BLOCK = 32\n", "BLOCK = 64\n")

    _land(bench_project, "Stack: shift by 64")
    bench_project.git("commit", "-q", "--allow-empty", "-m", "Docs", cwd=bench_project.root)
    assert build(bench_project).returncode == 0  # landed: the revision before it
    assert _helpers(package, "before") == "BLOCK = 32\n"

    assert build(bench_project, "--before", "none").returncode == 0
    assert not (package / "trees" / "before").exists()
    objects = bench_project.git("count-objects")
    assert build(bench_project, "--before", first).returncode == 0
    assert _helpers(package, "before") == "BLOCK = 32\n"
    # Its stack was applied with objects of its own: build/vllm is only read.
    assert bench_project.git("count-objects") == objects
    result = build(bench_project, "--before", "nope")
    assert result.returncode == 1
    assert "--before 'nope': no such commit of this project" in result.stderr


def test_rev_takes_a_project_commit_and_builds_its_stack_as_before_does(bench_project):
    """`--rev LABEL=REV` names a revision of build/vllm or, where there is none,
    a project commit: its patches/ stack applied to the release, as `--before`
    builds it (build/vllm is only read)."""
    root = bench_project.root
    bench_project.git("init", "-q", cwd=root)
    first = _land(bench_project, "Stack: shift by 32")
    bench_project.commit("[Kernel] Shift by 64", {"vllm/kernels/helpers.py": "BLOCK = 64\n"})
    _land(bench_project, "Stack: shift by 64")
    package = package_of(bench_project)
    objects = bench_project.git("count-objects")

    result = build(bench_project, "--before", "none", "--rev", f"landed={first[:7]}")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((package / "trees.json").read_text())
    assert [(t["label"], t["rev"]) for t in manifest["trees"]] == [
        ("pristine", f"vllm-{V1}"), ("patched", "HEAD"), ("landed", f"project {first[:9]}")]
    assert (_helpers(package, "landed"), _helpers(package, "patched")) == (
        "BLOCK = 32\n", "BLOCK = 64\n")
    assert bench_project.git("count-objects") == objects
    # A revision of build/vllm comes first (HEAD~1 names a commit in both).
    assert build(bench_project, "--before", "none", "--rev", "older=HEAD~1").returncode == 0
    manifest = json.loads((package / "trees.json").read_text())
    assert manifest["trees"][2] == {"label": "older", "rev": "HEAD~1",
                                    "commit": bench_project.git("rev-parse", "HEAD~1")}


def test_a_project_commit_whose_stack_is_an_older_releases_names_the_branch_to_pass(
        bench_project):
    """Say BENCHMARKS.md's `--rev landed=4dd980a`: that commit's stack is on
    the previous release and does not apply to the pinned one; `make rebase`
    kept it in build/vllm as branch stack-<old version>."""
    root = bench_project.root
    bench_project.git("init", "-q", cwd=root)
    first = _land(bench_project, "Stack: shift by 32")
    patch = next(bench_project.patches.glob("*.patch"))
    pin = root / "pin.toml"
    patch.write_text(patch.read_text().replace("-BLOCK = 16", "-BLOCK = 8"))
    pin.write_text(pin.read_text().replace(f'version = "{V1}"', 'version = "0.0.9"'))
    bench_project.git("commit", "-q", "-am", "Stack on 0.0.9", cwd=root)
    older = bench_project.git("rev-parse", "HEAD", cwd=root)
    bench_project.git("checkout", "-q", first, "--", "pin.toml", "patches", cwd=root)
    bench_project.git("commit", "-q", "-m", f"Move to {V1}", cwd=root)

    result = build(bench_project, "--before", "none", "--rev", f"landed={older[:7]}")
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert (f"--rev landed={older[:7]}: project commit {older[:9]}: its stack does not apply "
            f"to the pinned release ({patch.name} does not); it is vLLM 0.0.9's stack, the "
            f"pin is {V1}: `make rebase` keeps the previous release's stack in build/vllm as "
            "branch stack-<old version>; build/vllm has no branch stack-0.0.9 (no rebase from "
            f"0.0.9 ran there): run gpubench in a checkout of project commit {older[:9]} after "
            "`make apply` there, or name a revision of build/vllm") in result.stderr
    assert not package_of(bench_project).exists()
    bench_project.git("branch", "stack-0.0.9", f"vllm-{V1}")  # as `make rebase` leaves it
    result = build(bench_project, "--before", older[:7])  # --before builds it the same way
    assert result.returncode == 1
    assert (f"--before {older[:7]}: project commit {older[:9]}: its stack does not apply"
            in result.stderr)
    assert result.stderr.rstrip().endswith("; pass --rev before=stack-0.0.9")
    assert build(bench_project, "--rev", "before=stack-0.0.9").returncode == 0


def test_without_history_there_is_no_before_tree_and_it_says_why(bench_project):
    result = build(bench_project)
    assert result.returncode == 0, result.stderr
    assert "no tree 'before'" in result.stdout and "not a git checkout" in result.stdout


def test_the_case_entry_loads_each_tree_from_its_own_files(bench_project, tmp_path):
    """`python3 build/gpubench/cases/mla_decode.py` (the runbook's kernels
    step) loads each tree's kernel module through `load_tree`: each must import
    its own tree's modules, also one that the first tree lacks."""
    pytest.importorskip("torch")
    bench_project.commit("[Kernel] Shift from a new module", {
        "vllm/kernels/shift.py": "SHIFT = 7\n",
        "vllm/kernels/helpers.py": "from vllm.kernels.shift import SHIFT\n\nBLOCK = 32 + SHIFT\n",
    })
    assert build(bench_project, "--rev", "older=HEAD~1").returncode == 0
    package = package_of(bench_project)
    shutil.copy2(RUNNER / "cases" / "mla_decode.py", package / "cases")
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "cases")
        import mla_decode
        for tree in json.load(open("trees.json"))["trees"]:
            load = mla_decode.load_tree(tree["label"])
            print(tree["label"], load("vllm.kernels.helpers").BLOCK)
    """)
    result = subprocess.run([PYTHON, "-c", script], cwd=package, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pristine", "16", "patched", "39", "older", "32"]


@pytest.mark.parametrize("change, message", [
    ({"vllm/kernels/add.py": ADD.replace("import tl, triton", "import gluon, tl, triton")},
     "vllm/kernels/add.py imports gluon from vllm.triton_utils; the benchmark's stand-in "
     "provides only HAS_TRITON, tl, tldevice, triton"),
    ({"vllm/kernels/add.py": ADD.replace("is_rocm()", "fp8_dtype()")},
     "vllm/kernels/add.py uses current_platform.fp8_dtype; the stand-in for vllm.platforms"),
    ({"vllm/kernels/helpers.py": "from vllm.triton_utils.importing import HAS_TRITON\n"},
     "vllm/kernels/helpers.py imports vllm.triton_utils.importing, which the benchmark's "
     "stand-ins do not provide"),
    ({"vllm/kernels/helpers.py": "from vllm.gone import BLOCK\n"},
     "vllm/kernels/helpers.py imports vllm.gone, which is not in the tree"),
], ids=["name", "attribute", "submodule", "missing"])
def test_what_the_package_cannot_hold_is_one_line_and_keeps_the_old_package(
        bench_project, change, message):
    assert build(bench_project).returncode == 0
    before = snapshot(package_of(bench_project))
    bench_project.commit("[Kernel] Change", change)
    result = build(bench_project)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert snapshot(package_of(bench_project)) == before


@pytest.mark.parametrize("args, message", [
    (["--case", "nope"], "no benchmark case 'nope': expected benchmarks/gpu/cases/nope.py "
                         "(cases: add)"),
    (["--rev", "before"], "--rev 'before': expected LABEL=REV, e.g. before=HEAD~1"),
    (["--rev", "patched=HEAD~1"], "tree labels must differ"),
    # Looked for in both places a REV may name: build/vllm and the project.
    (["--rev", "old=v9"], "--rev old=v9: no commit 'v9' for tree 'old' in build/vllm (a vLLM "
                          "revision) nor in this project's history ("),
], ids=["case", "rev-syntax", "rev-label", "rev-missing"])
def test_bad_arguments_name_the_next_step(bench_project, args, message):
    result = build(bench_project, *args)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not package_of(bench_project).exists()


def test_a_case_file_in_no_tree_is_named(bench_project):
    case = bench_project.root / "benchmarks" / "gpu" / "cases" / "add.py"
    case.write_text(CASE.replace("vllm/kernels/add.py", "vllm/kernels/gone.py"))
    result = build(bench_project)
    assert result.returncode == 1
    assert ("benchmark case 'add': vllm/kernels/gone.py is in none of the trees "
            f"(pristine = vllm-{V1}, patched = HEAD)") in result.stderr
    case.write_text("FILES = ['vllm/kernels/add.py']\n")
    result = build(bench_project)
    assert "benchmarks/gpu/cases/add.py must set FILES to a tuple" in result.stderr


def test_a_folder_that_is_no_package_is_never_replaced(bench_project, tmp_path):
    mine = tmp_path / "elsewhere" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me\n")
    result = build(bench_project, "--package", mine)
    assert result.returncode == 1
    assert "is not a benchmark package (no trees.json)" in result.stderr
    assert (mine / "notes.txt").read_text() == "keep me\n"
    assert sorted(p.name for p in mine.parent.iterdir()) == ["mine"]  # no staging left


def test_without_a_gpu_it_builds_and_says_where_to_run(bench_project):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the runner would start")
    result = bench_project.run("gpubench", timeout=180)
    assert result.returncode == 0, result.stderr
    assert "no GPU visible to this Python" in result.stdout
    assert "run `python3 build/gpubench/run.py` there" in result.stdout


def test_each_tree_runs_its_own_kernel_through_the_stand_ins(bench_project):
    """The runner's Tree imports every tree as `vllm` in turn; the stand-ins let
    real Triton (its interpreter here) compile and run the kernels."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    assert build(bench_project).returncode == 0
    script = textwrap.dedent("""
        import sys
        import torch
        import run
        case = run.load_case("add")
        trees = [run.Tree(label, run.HERE / "trees" / label)
                 for label in ("pristine", "patched")]
        calls, notes = run.bind_trees(case, trees)
        x = case.make_inputs(case.SHAPES[0], torch.device("cpu"), None)
        print([calls[label](x).tolist()[:2] for label in ("pristine", "patched")])
        print(sorted(n for n in sys.modules if n.startswith("vllm")))
        print(run.default_same_output(calls["pristine"](x), calls["patched"](x)))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(package_of(bench_project))}
    result = subprocess.run([PYTHON, "-c", script], cwd=package_of(bench_project),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == ["[[16, 17], [32, 33]]", "[]", "False"]


# Shaped like vLLM 0.34.0's draft_logits.py: rejection_sample's DraftLogitsCache
# imports the tensor-parallel group, the input batch and the batch-sharding
# helpers, all of them heavy; a replicated cache uses none of them.
DRAFT_LOGITS = '''\
from vllm.distributed.parallel_state import get_tp_group
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.batch_shard import shard_owner, shard_owners, shard_row, shard_rows


class DraftLogitsCache:
    def __init__(self, values, sharded=False):
        self.row_mapping = None
        if sharded:
            self.shards = get_tp_group().world_size
            self.rows = shard_rows(len(values), self.shards)
        self.values = values

    def stale_drafts(self, input_batch: InputBatch):
        return None
'''


def test_the_draft_logits_caches_heavy_imports_are_stand_ins(bench_project):
    """The package takes stand-ins for what the draft logits cache imports, so a
    replicated cache builds there, and a batch-sharded one says why it cannot."""
    heavy = {path: HEAVY for path in ("vllm/distributed/parallel_state.py",
                                      "vllm/v1/worker/gpu/input_batch.py",
                                      "vllm/v1/worker/gpu/sample/batch_shard.py")}
    bench_project.commit("[Spec Decode] A draft logits cache",
                         {**heavy, "vllm/kernels/draft_logits.py": DRAFT_LOGITS})
    case = bench_project.root / "benchmarks" / "gpu" / "cases" / "add.py"
    case.write_text(case.read_text().replace(
        'FILES = ("vllm/kernels/add.py",)',
        'FILES = ("vllm/kernels/add.py", "vllm/kernels/draft_logits.py")'))
    assert build(bench_project).returncode == 0
    vllm = package_of(bench_project) / "trees" / "patched" / "vllm"
    assert (vllm / "kernels" / "draft_logits.py").read_text() == DRAFT_LOGITS
    assert not any((vllm / path).exists() for path in heavy)
    script = textwrap.dedent("""
        from vllm.kernels.draft_logits import DraftLogitsCache
        print(DraftLogitsCache([1.0]).values)
        try:
            DraftLogitsCache([1.0], sharded=True)
        except RuntimeError as e:
            print(e)
    """)
    result = subprocess.run([PYTHON, "-c", script], cwd=vllm.parent, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[1.0]", ("no tensor-parallel group here (a stand-in of the benchmark package): "
                  "only a replicated DraftLogitsCache can be built")]


# --- the runner's summaries and table (benchmarks/gpu/stats.py) ---------------------------


def _runner_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpubench_{name}", RUNNER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


stats = _runner_module("stats")


def test_summary_is_median_and_deciles():
    summary = stats.Summary.of([float(x) for x in range(1, 12)])  # 1..11
    assert (summary.median, summary.p10, summary.p90, summary.count) == (6, 2, 10, 11)
    assert stats.Summary.of([3.0]) == stats.Summary(3.0, 3.0, 3.0, 1)
    with pytest.raises(ValueError):
        stats.Summary.of([])


def test_ratios_pair_each_replay_with_the_baseline():
    # The baseline drifts (10 -> 20); the patched tree is 10% slower in every replay.
    baseline = [10.0, 20.0, 10.0, 20.0, 10.0]
    patched = [11.0, 22.0, 11.0, 22.0, 11.0]
    rows = stats.rows_for_shape("block, 1 req",
                                {"patched": patched, "pristine": baseline, "new": None},
                                {"patched": False},
                                {"new": "not in this tree: vllm.kernels.add"})
    assert [r.tree for r in rows] == ["pristine", "patched", "new"]
    pristine, patched_row, new = rows
    assert pristine.ratio is None and pristine.same_output is None
    assert patched_row.ratio.median == pytest.approx(1.1)
    assert patched_row.ratio.p10 == pytest.approx(1.1)
    assert patched_row.ratio.p90 == pytest.approx(1.1)
    assert patched_row.micros.median == 11.0 and patched_row.same_output is False
    assert new.micros is None and new.ratio is None
    with pytest.raises(ValueError, match="3 replays against 2"):
        stats.paired_ratios([1.0, 2.0, 3.0], [1.0, 2.0])


def test_table_shows_times_ratios_and_what_differs():
    rows = stats.rows_for_shape("standard, 16 req",
                                {"pristine": [40.0, 40.0], "patched": [40.4, 40.4],
                                 "new": None},
                                {"patched": True}, {"new": "not in this tree: vllm.x"})
    rows += stats.rows_for_shape("standard, 64 req",
                                 {"pristine": [100.0], "patched": [90.0]}, {"patched": False})
    table = stats.format_table("case rejection_sample", rows).splitlines()
    assert table[0] == "case rejection_sample"
    assert table[1].split() == ["shape", "tree", "median", "p10", "p90", "/pristine",
                                "ratio", "p10-p90", "same", "output"]
    body = [line.split() for line in table[3:]]
    assert body == [
        ["standard,", "16", "req", "pristine", "40.00", "40.00", "40.00", "1"],
        ["patched", "40.40", "40.40", "40.40", "1.010", "1.010-1.010", "yes"],
        ["new", "n/a", "(not", "in", "this", "tree:", "vllm.x)"],
        ["standard,", "64", "req", "pristine", "100.00", "100.00", "100.00", "1"],
        ["patched", "90.00", "90.00", "90.00", "0.900", "0.900-0.900", "NO"],
    ]


def test_enough_input_sets_to_leave_the_l2_cold():
    pytest.importorskip("torch")
    timing = _runner_module("timing")
    l2 = 60 * 2**20
    assert timing.input_set_count(7 * 2**20, l2) == 26  # 3 caches' worth
    assert timing.input_set_count(400 * 2**20, l2) == 2  # never one set twice in a row
    assert timing.input_set_count(1024, l2) == 64  # capped
    import torch

    assert timing.nbytes({"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.int64)],
                          "k": 3}) == 32


def test_a_kernel_file_that_is_not_utf8_at_a_revision_is_one_line(bench_project):
    (bench_project.tree / "vllm/kernels/helpers.py").write_bytes(b"# caf\xe9\nBLOCK = 8\n")
    bench_project.git("commit", "-q", "-a", "-m", "[Kernel] Latin-1")
    result = build(bench_project, "--rev", "before=HEAD~1")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert ("tree patched (HEAD): vllm/kernels/helpers.py is not UTF-8 (byte 5)"
            in result.stderr)



def test_without_amd_aiter_the_build_leaves_out_the_case_that_needs_it(bench_project, tmp_path):
    """A Python without amd-aiter (a plain module named aiter hides the
    installed one) builds every other case and says in one line which it
    skipped and why; naming that case stops, saying which Python to use."""
    shutil.copy2(RUNNER / "cases" / "aiter_rope_cache.py", bench_project.root / "benchmarks"
                 / "gpu" / "cases")
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "aiter.py").write_text("")
    env = bench_project.env()
    env["PYTHONPATH"] = f"{tmp_path / 'hide'}{os.pathsep}{env['PYTHONPATH']}"

    def gpubench(*args):
        return subprocess.run([PYTHON, "-m", "scripts", "gpubench", "--build-only", *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    result = gpubench()
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stdout.splitlines() if "aiter_rope_cache" in line]
    assert skipped == [f"skipped case aiter_rope_cache: it copies aiter's modules and this "
                       f"Python ({PYTHON}) has no amd-aiter installed; .venv/bin/python "
                       "builds it too"]
    assert json.loads((package_of(bench_project) / "trees.json").read_text())["cases"] == [
        "add"]
    result = gpubench("--case", "aiter_rope_cache")
    assert result.returncode == 1
    assert "no amd-aiter installed: run gpubench with .venv/bin/python" in result.stderr


def test_help_says_case_and_rev_repeat(project):
    out = " ".join(project.ok("gpubench", "--help").stdout.split())
    assert "benchmark case, repeatable" in out
    assert "--rev LABEL=REV one more tree to time" in out


# --- a case of other sources: release csrc/ and aiter's Triton modules ---------------------

CASE_DIR = RUNNER / "cases"
# Shaped like the release files whose device code aiter_rope_cache.py cuts out.
POS_ENCODING = """#include "torch_utils.h"

namespace vllm {

template <typename scalar_t>
__global__ void rotary_embedding_kernel(scalar_t* q) { if (q) { q[0] = q[0]; } }

}  // namespace vllm

void rotary_embedding() { /* the host side, left behind */ }
"""
CACHE_KERNELS = """namespace vllm {

template <typename scalar_t, typename cache_t, Fp8KVCacheDataType kv_dt,
          bool skip_scale>
__global__ void concat_and_cache_mla_kernel(
    const scalar_t* __restrict__ kv_c  // [num_tokens, kv_lora_rank]
) {
  auto copy = [&](int i) { if (i) { return; } };
  copy(0);
}

template <typename scalar_t>
__global__ void other_kernel() {}

}  // namespace vllm
"""

CACHE_KERNELS_FUSED = """namespace vllm {

template <typename qk_t, typename cos_sin_t, bool IS_NEOX>
__global__ void concat_and_cache_mla_rope_fused_kernel(qk_t* q_pe) {
  if (q_pe) { q_pe[0] = q_pe[0]; }
}

}  // namespace vllm

void concat_and_cache_mla_rope_fused() { /* its host side, left behind */ }
"""


def _aiter_installed() -> Path:
    spec = importlib.machinery.PathFinder.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("amd-aiter is not installed in this Python")
    return Path(list(spec.submodule_search_locations)[0])


def _case_value(name: str, variable: str):
    import ast

    tree = ast.parse((CASE_DIR / f"{name}.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == variable for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name}.py sets no {variable}")


@pytest.fixture
def native_project(project):
    """A release that holds the csrc/ files aiter_rope_cache.py names (the three
    kernel files shaped like the release's), and that case in the runner."""
    csrc = {path: b"// header\n" for path in _case_value("aiter_rope_cache", "CSRC")}
    csrc["csrc/pos_encoding_kernels.cu"] = POS_ENCODING.encode()
    csrc["csrc/cache_kernels.cu"] = CACHE_KERNELS.encode()
    csrc["csrc/cache_kernels_fused.cu"] = CACHE_KERNELS_FUSED.encode()
    project.use_release(V1, files={**release_files(V1), **csrc})
    project.ok("apply")
    runner = project.root / "benchmarks" / "gpu"
    (runner / "cases").mkdir(parents=True)
    for name in ("run.py", "stats.py", "timing.py"):
        shutil.copy2(RUNNER / name, runner / name)
    shutil.copy2(CASE_DIR / "aiter_rope_cache.py", runner / "cases")
    return project


def test_a_case_takes_release_csrc_and_aiter_modules(native_project):
    """CSRC comes from the release tree, AITER from the installed wheel with
    every aiter module it imports; aiter's package __init__ files are empty
    (the wheel's needs ROCm); trees.json names where each came from."""
    folder = _aiter_installed()
    result = build(native_project, "--case", "aiter_rope_cache")
    assert result.returncode == 0, result.stderr
    package = package_of(native_project)
    manifest = json.loads((package / "trees.json").read_text())
    # It times no vLLM file, so no previous revision is looked for.
    assert [t["label"] for t in manifest["trees"]] == ["pristine", "patched"]
    assert manifest["csrc"]["label"] == "pristine"
    assert manifest["csrc"]["rev"] == f"vllm-{V1}"
    csrc = _case_value("aiter_rope_cache", "CSRC")
    assert sorted(manifest["csrc"]["files"]) == sorted(csrc)
    assert (package / "csrc" / "cache_kernels.cu").read_text() == CACHE_KERNELS
    for path, digest in manifest["csrc"]["files"].items():
        assert hashlib.sha256((package / path).read_bytes()).hexdigest() == digest
    triton_dir = "aiter/ops/triton"
    # The two entry modules and what they import (the rope helpers, the
    # logger, the BMM's arch query, config path and kernel repr).
    assert sorted(manifest["aiter"]["files"]) == sorted(
        f"{triton_dir}/{name}.py" for name in (
            "fused_kv_cache", "_triton_kernels/fused_kv_cache", "rope", "_triton_kernels/rope",
            "utils/logger", "batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_"
            "tensor_quant", "_triton_kernels/batched_gemm_a8w8_a_per_token_group_prequant_"
            "w_per_batched_tensor_quant", "utils/_triton/arch_info",
            "utils/_triton/kernel_repr", "utils/core"))
    for path, digest in manifest["aiter"]["files"].items():
        data = (package / path).read_bytes()
        assert data == (folder.parent / path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
    inits = sorted(p.relative_to(package).as_posix() for p in (package / "aiter").rglob("*")
                   if p.name == "__init__.py")
    assert "aiter/__init__.py" in inits and f"{triton_dir}/__init__.py" in inits
    assert all((package / p).read_bytes() == b"" for p in inits)
    assert manifest["aiter"]["version"] != "unknown"


@pytest.mark.parametrize("entry, message", [
    ("vllm/kernels/add.py", "CSRC entry 'vllm/kernels/add.py': expected a file under csrc/"),
    ("csrc/gone.cu", "CSRC entry csrc/gone.cu: not in tree pristine"),
], ids=["outside-csrc", "missing"])
def test_a_csrc_entry_the_release_lacks_is_one_line(bench_project, entry, message):
    case = bench_project.root / "benchmarks" / "gpu" / "cases" / "add.py"
    case.write_text(case.read_text() + f"CSRC = ({entry!r},)\n")
    result = build(bench_project)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_fused_rope_cache_case_runs_aiters_kernel_in_the_interpreter(native_project):
    """The case's CPU parts, on the built package: the release kernels' text
    cut from csrc/, and aiter's fused kernel (Triton's interpreter, with the
    harness's workarounds for it) called as the drafter calls it, against a
    float64 rotation and the cache rows it must write."""
    _aiter_installed()
    pytest.importorskip("triton")
    assert build(native_project, "--case", "aiter_rope_cache").returncode == 0
    package = package_of(native_project)
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        sys.path[:0] = [sys.argv[1], "cases"]
        from tests.verification.harness import aiter as harness
        for workaround in harness.INTERPRETER_WORKAROUNDS:
            workaround()
        import torch
        import aiter_rope_cache as case
        text = case.release_kernels(Path("csrc"))
        print("rotary" in text, "concat_and_cache_mla_kernel" in text,
              "concat_and_cache_mla_rope_fused_kernel" in text,
              "other_kernel" in text, "host side" in text)
        fused_kv_cache = case.load_aiter()
        print(Path(fused_kv_cache.__file__).resolve().is_relative_to(Path.cwd()))
        table = case.yarn_cos_sin_cache()
        cos, sin = table.chunk(2, dim=-1)
        for kv in case.KV_DTYPES:
            shape = dict(reqs=2, heads=4, page=16, kv=kv)
            x = case.make_inputs(shape, "cpu", torch.Generator().manual_seed(1), table)
            cache = case.make_cache(shape, "cpu")
            q_in, k_in = x["q"].clone(), x["k_pe"].clone()
            k_scale = torch.tensor([case.K_SCALE])
            call = case.fused_call(fused_kv_cache, shape, cos, sin, k_scale)
            q_out, k_pe_out = call(x, cache)
            rope = case.NOPE_DIM
            q_ref = q_in.clone()
            q_ref[:, :, rope:] = case.rotation_reference(q_in[:, :, rope:], x["positions"],
                                                         table).bfloat16()
            k_ref = case.rotation_reference(k_in, x["positions"], table).bfloat16()
            rows = cache.view(-1, cache.shape[-1])
            want = torch.cat([x["kv_c_normed"], k_ref.squeeze(1)], -1)
            got = rows[x["slots"]]
            if kv == "fp8":
                want, got = (want.float() / case.K_SCALE).to(case.FP8), got.view(case.FP8)
            steps = case.steps_apart(got, want)
            others = torch.ones(rows.shape[0], dtype=torch.bool)
            others[x["slots"]] = False
            print(kv, int(case.steps_apart(q_out, q_ref).max()),
                  int(case.steps_apart(k_pe_out, k_ref).max()),
                  int(steps[:, :case.KV_LORA_RANK].max()), int(steps[:, case.KV_LORA_RANK:].max()),
                  bool((rows[others].view(torch.uint8) == 0xFF).all()),
                  torch.equal(x["q"], q_in))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ""}
    result = subprocess.run([PYTHON, "-c", script, str(REPO)], cwd=package, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    # bf16: both round the fp32 rotation once (the interpreter's rounding made
    # to match compiled Triton's); fp8: the kernel rounds the rotation once to
    # e4m3, the reference through bf16, so rope elements may be one step apart.
    assert result.stdout.splitlines() == [
        "True True True False False", "True",
        "bf16 0 0 0 0 True True", "fp8 0 0 0 1 True True"]
