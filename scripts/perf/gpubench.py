"""`python3 -m scripts gpubench`: time the stack's GPU kernels against the release.

Builds build/gpubench/, a small self-contained package: the runner
(benchmarks/gpu/: plain Python, torch and Triton) plus, for each vLLM tree
(`pristine` = the release tag, `patched` = HEAD of build/vllm, and any
`--rev LABEL=REV`), the files the cases call and the vllm modules they import,
read with `git show`. REV is a revision of build/vllm or, where it names none
there, a commit of this project, whose patches/ stack is applied to the
release the way `before`'s is (below). vllm.triton_utils and vllm.platforms become stand-ins
(and so do the tensor-parallel and batch-sharding modules that the draft
logits cache imports; STANDINS), so the package runs on a GPU machine without
vLLM (e.g. an image with an older torch), as `python3 build/gpubench/run.py`.
If this Python sees a GPU, the runner is started right away.

Every package also holds `before`: the previous landed revision of the files
the cases time. A kernel can beat the release and still be slower than its own
last revision, so each run compares with both. It is the stack of the newest
commit of this project (`git log -- patches/`) whose series gives those files
other contents than `patched`, applied to the release in a scratch index with
its own object folder (build/vllm is only read; ProjectStacks); `--before
REV` names the project commit instead, `--before none` leaves it out.

A case may also name files that are no vLLM Python: CSRC, files of the
release's csrc/ (read from the `pristine` tree into csrc/ of the package), and
AITER, modules of AMD's aiter (read from the installed `amd-aiter` wheel, with
every aiter module they import, into aiter/ of the package; its package
__init__ files are empty there, since aiter's own needs ROCm). trees.json
records where each came from and each file's sha256.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from scripts.common import Layout, StackError, rel, say
from scripts.stack.gitrepo import git
from scripts.stack.pin import Pin, load_pin
from scripts.stack.series import apply_to_index, read_series

RUNNER_FILES = ("run.py", "stats.py", "timing.py")
MANIFEST = "trees.json"
BASELINE = "pristine"
BEFORE = "before"
# Project commits searched for the previous revision of the timed files.
BEFORE_HISTORY = 100
# A kernel file with a handful of Triton helpers; more means an import reached
# the heavy parts of vLLM, which the package cannot hold.
MAX_MODULES_PER_TREE = 40
MAX_PACKAGE_BYTES = 16 * 2**20

_TRITON_UTILS = '''\
"""Stand-in for vllm.triton_utils, written by `python3 -m scripts gpubench`."""
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
'''

_PLATFORMS = '''\
"""Stand-in for vllm.platforms, written by `python3 -m scripts gpubench`."""
import torch


class _Platform:
    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cuda(self) -> bool:
        return torch.version.cuda is not None and not self.is_rocm()

    def is_cuda_alike(self) -> bool:
        return True

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.is_rocm() else torch.float8_e4m3fn


current_platform = _Platform()
'''

_ROCM_PLATFORM = '''\
"""Stand-in for vllm.platforms.rocm, written by `python3 -m scripts gpubench`."""
import torch


def _arch() -> str:
    if torch.version.hip is None:
        return ""
    return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]


def on_gfx942() -> bool:
    return _arch() == "gfx942"


def on_gfx950() -> bool:
    return _arch() == "gfx950"
'''

_MEM_UTILS = '''\
"""Stand-in for vllm.utils.mem_utils, written by `python3 -m scripts gpubench`."""
import torch


def get_max_shared_memory_bytes(gpu: int = 0) -> int:
    return torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin
'''


# vllm.v1.worker.gpu.spec_decode.draft_logits (DraftLogitsCache, which
# rejection_sample takes since vLLM 0.34.0) imports these three (all of vLLM
# behind them) for its batch-sharded cache only; a replicated cache needs none.
# amd_resources/kernel_tree.py loads the tree's kernel files with them too.
_PARALLEL_STATE = '''\
"""Stand-in for vllm.distributed.parallel_state, written by `python3 -m scripts gpubench`."""


def get_tp_group():
    raise RuntimeError("no tensor-parallel group here (a stand-in of the benchmark "
                       "package): only a replicated DraftLogitsCache can be built")
'''

_INPUT_BATCH = '''\
"""Stand-in for vllm.v1.worker.gpu.input_batch, written by `python3 -m scripts gpubench`."""


class InputBatch:
    """Named in annotations only."""
'''

_BATCH_SHARD = '''\
"""Stand-in for vllm.v1.worker.gpu.sample.batch_shard, written by `python3 -m scripts gpubench`."""


def _batch_sharded(*args, **kwargs):
    raise RuntimeError("no batch-sharded sampling here (a stand-in of the benchmark "
                       "package): only a replicated DraftLogitsCache can be built")


shard_owner = shard_owners = shard_row = shard_rows = _batch_sharded
'''

DRAFT_LOGITS_STANDINS = ("vllm.distributed.parallel_state", "vllm.v1.worker.gpu.input_batch",
                         "vllm.v1.worker.gpu.sample.batch_shard")


@dataclass(frozen=True)
class StandIn:
    source: str
    names: frozenset[str]  # what `from <module> import ...` may take
    attributes: dict[str, frozenset[str]]  # name -> attributes the files may use


STANDINS = {
    "vllm.triton_utils": StandIn(
        _TRITON_UTILS, frozenset({"triton", "tl", "tldevice", "HAS_TRITON"}), {}),
    "vllm.platforms": StandIn(
        _PLATFORMS, frozenset({"current_platform"}),
        {"current_platform": frozenset({"is_rocm", "is_cuda", "is_cuda_alike"})}),
    # Imported where a kernel file picks its tiles (vLLM's own queries).
    "vllm.platforms.rocm": StandIn(_ROCM_PLATFORM, frozenset({"on_gfx942", "on_gfx950"}), {}),
    "vllm.utils.mem_utils": StandIn(
        _MEM_UTILS, frozenset({"get_max_shared_memory_bytes"}), {}),
    "vllm.distributed.parallel_state": StandIn(_PARALLEL_STATE, frozenset({"get_tp_group"}), {}),
    "vllm.v1.worker.gpu.input_batch": StandIn(_INPUT_BATCH, frozenset({"InputBatch"}), {}),
    "vllm.v1.worker.gpu.sample.batch_shard": StandIn(
        _BATCH_SHARD, frozenset({"shard_owner", "shard_owners", "shard_row", "shard_rows"}), {}),
}


@dataclass(frozen=True)
class TreeSpec:
    label: str
    rev: str
    commit: str  # a commit or a tree of the source repository
    # Git environment to read it with (the before tree's scratch object folder).
    git_env: tuple[tuple[str, str], ...] = ()

    def manifest(self) -> dict[str, str]:
        return {"label": self.label, "rev": self.rev, "commit": self.commit}


def gpubench(layout: Layout, cases: list[str] | None, package: Path | None,
             source: Path | None, revs: list[str], build_only: bool,
             before: str = "auto") -> int:
    source = source or layout.tree
    package = package or layout.gpubench_package
    runner = layout.gpu_benchmarks
    pin = load_pin(layout.pin_file)
    names = cases or buildable_cases(runner)
    with tempfile.TemporaryDirectory(prefix="k3-gpubench-objects-") as objects:
        stacks = ProjectStacks(layout.root, source, pin, Path(objects))
        trees = resolve_trees(source, pin.base_tag, revs, stacks)
        files = sorted({f for name in names for f in case_files(runner, name)})
        if before != "none" and files and all(t.label != BEFORE for t in trees):
            found = (landed_before(stacks, trees, files) if before == "auto"
                     else _named_before(stacks, before, trees[0]))
            trees[1:1] = [found] if found else []
        build_package(runner, source, trees, names, package)
    size = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    say(f"built {rel(package, layout)} ({size // 1024} KiB): cases {', '.join(names)}; "
        + ", ".join(f"{t.label} = {t.rev} ({t.commit[:12]})" for t in trees))
    command = [sys.executable, str(package / "run.py")]
    for name in cases or []:
        command += ["--case", name]
    if build_only:
        return 0
    if not _sees_a_gpu():
        say("no GPU visible to this Python (torch with CUDA or ROCm): copy the folder to "
            f"a GPU machine and run `python3 {rel(package, layout)}/run.py` there")
        return 0
    return subprocess.run(command).returncode


def available_cases(runner: Path) -> list[str]:
    return sorted(p.stem for p in (runner / "cases").glob("*.py"))


def buildable_cases(runner: Path) -> list[str]:
    """Every case, less those that copy aiter's modules where this Python has
    no amd-aiter (said in one line): what gpubench builds without --case."""
    names = available_cases(runner)
    skipped = [] if _aiter_spec() else [n for n in names if case_tuple(runner, n, "AITER")]
    if skipped:
        say(f"skipped case {', '.join(skipped)}: it copies aiter's modules and this Python "
            f"({sys.executable}) has no amd-aiter installed; .venv/bin/python builds it too")
    return [n for n in names if n not in skipped]


class NoStack(Exception):
    """Why a project commit's stack gives no tree on the release."""


@dataclass(frozen=True)
class ProjectStacks:
    """The patches/ stacks of this project's commits, applied to the release
    of `source` in a scratch index whose objects go to `objects`: build/vllm
    is only read. Trees built here are read with `env`."""

    project: Path
    source: Path
    pin: Pin
    objects: Path

    @property
    def env(self) -> dict[str, str]:
        return {"GIT_OBJECT_DIRECTORY": str(self.objects),
                "GIT_ALTERNATE_OBJECT_DIRECTORIES":
                    str((self.source / ".git" / "objects").resolve())}

    def has_history(self) -> bool:
        return git(self.project, "rev-parse", "--git-dir", check=False).returncode == 0

    def commit(self, rev: str) -> str | None:
        """The project commit `rev` names; None where there is none (or no
        git checkout)."""
        found = git(self.project, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}",
                    check=False)
        return found.stdout.strip() if found.returncode == 0 else None

    def tree(self, commit: str, base: str) -> str:
        """The tree of the stack at `commit` applied to `base`; NoStack says
        why there is none."""
        with tempfile.TemporaryDirectory(prefix="k3-gpubench-patches-") as scratch:
            folder = Path(scratch) / "patches"
            folder.mkdir()
            # The series and the patch files: the blobs of patches/ itself.
            for line in git(self.project, "ls-tree", commit, "patches/").stdout.splitlines():
                meta, _, path = line.partition("\t")
                if meta.split()[1] == "blob":
                    data = git(self.project, "show", f"{commit}:{path}", text=False).stdout
                    (folder / PurePosixPath(path).name).write_bytes(data)
            try:
                patches = read_series(Layout(Path(scratch)))
            except StackError as e:
                raise NoStack(f"its patches/ cannot be read ({e})")
            applied = apply_to_index(self.source, base, patches, self.env)
        if applied.tree is None:
            raise NoStack(f"its stack does not apply to the pinned release "
                          f"({applied.stopped_at} does not)")
        return applied.tree

    def pinned_version(self, commit: str) -> str | None:
        """The vLLM version pin.toml named at `commit`, if it can be read."""
        shown = git(self.project, "show", f"{commit}:pin.toml", check=False)
        try:
            return str(tomllib.loads(shown.stdout)["vllm"]["version"])
        except (tomllib.TOMLDecodeError, KeyError, TypeError):
            return None


def resolve_trees(source: Path, base_tag: str, revs: list[str],
                  stacks: ProjectStacks) -> list[TreeSpec]:
    """pristine = the release tag, patched = HEAD, then each LABEL=REV: a
    revision of `source`, else a project commit's stack on the release."""
    if not (source / ".git").exists():
        raise StackError(f"{source} is not a git repository of vLLM: run `make apply` "
                         "first, or name one with --source")
    wanted = [(BASELINE, base_tag), ("patched", "HEAD")] + [_label_and_rev(r) for r in revs]
    labels = [label for label, _ in wanted]
    if len(set(labels)) != len(labels):
        raise StackError(f"--rev: tree labels must differ from each other and from "
                         f"{BASELINE!r} and 'patched': {', '.join(labels)}")
    trees = []
    for label, rev in wanted[:2]:
        if (tree := _source_tree(source, label, rev)) is None:
            raise StackError(f"{source}: no commit {rev!r} for tree {label!r}; "
                             "name an existing revision")
        trees.append(tree)
    for label, rev in wanted[2:]:
        trees.append(_source_tree(source, label, rev)
                     or _project_tree(stacks, label, rev, trees[0], f"--rev {label}={rev}"))
    return trees


def _label_and_rev(item: str) -> tuple[str, str]:
    label, sep, rev = item.partition("=")
    if (not sep or not label or not rev or rev.startswith("-")
            or not label.replace("-", "_").isidentifier()):
        raise StackError(f"--rev {item!r}: expected LABEL=REV, e.g. before=HEAD~1")
    return label, rev


def _source_tree(source: Path, label: str, rev: str) -> TreeSpec | None:
    """The tree `label` at revision `rev` of the vLLM repository, if it has one."""
    result = git(source, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    return TreeSpec(label, rev, result.stdout.strip()) if result.returncode == 0 else None


def _project_tree(stacks: ProjectStacks, label: str, rev: str, pristine: TreeSpec,
                  option: str) -> TreeSpec:
    """The tree `label`: the stack of project commit `rev` on the release."""
    commit = stacks.commit(rev)
    if commit is None:
        history = ("this project's history" if stacks.has_history()
                   else f"this project's history ({stacks.project} is no git checkout)")
        raise StackError(f"{option}: no commit {rev!r} for tree {label!r} in "
                         f"{rel(stacks.source)} (a vLLM revision) nor in {history} (a "
                         "project commit, its stack applied to the release); name one of "
                         "either")
    try:
        tree = stacks.tree(commit, pristine.commit)
    except NoStack as e:
        raise StackError(f"{option}: project commit {commit[:9]}: {e}; "
                         + _older_stack_hint(stacks, commit, label))
    return TreeSpec(label, f"project {commit[:9]}", tree, tuple(stacks.env.items()))


def _older_stack_hint(stacks: ProjectStacks, commit: str, label: str) -> str:
    """The next step where a project commit's stack does not apply: mostly it
    is an older release's, which `make rebase` kept as a branch."""
    version = stacks.pinned_version(commit)
    if version is None or version == stacks.pin.version:
        return "fix the stack at that commit, or name a revision of build/vllm that holds it"
    branch = f"stack-{version}"
    kept = git(stacks.source, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}",
               check=False).returncode == 0
    return (f"it is vLLM {version}'s stack, the pin is {stacks.pin.version}: `make rebase` "
            "keeps the previous release's stack in build/vllm as branch stack-<old version>; "
            + (f"pass --rev {label}={branch}" if kept else
               f"{rel(stacks.source)} has no branch {branch} (no rebase from {version} ran "
               f"there): run gpubench in a checkout of project commit {commit[:9]} after "
               "`make apply` there, or name a revision of build/vllm"))


def _named_before(stacks: ProjectStacks, before: str, pristine: TreeSpec) -> TreeSpec:
    """The tree `before` of `--before REV`: that project commit's stack."""
    if stacks.commit(before) is None:
        raise StackError(f"--before {before!r}: no such commit of this project; "
                         "name one from `git log -- patches/`, or pass --before none")
    return _project_tree(stacks, BEFORE, before, pristine, f"--before {before}")


def landed_before(stacks: ProjectStacks, trees: list[TreeSpec],
                  files: list[str]) -> TreeSpec | None:
    """The tree `before`: the newest landed stack whose `files` differ from the
    patched tree's; None when the project has no history here or no such
    revision."""
    if not stacks.has_history():
        say(f"no tree {BEFORE!r}: {stacks.project} is not a git checkout, so the previous "
            "revision of the timed files is unknown (pass --rev before=REV of build/vllm)")
        return None
    commits = git(stacks.project, "log", f"-{BEFORE_HISTORY}", "--format=%H", "HEAD",
                  "--", "patches/").stdout.split()
    source = stacks.source
    pristine, patched = trees[0], next(t for t in trees if t.label == "patched")
    current = _timed_sources(source, patched, files)
    for commit in commits:
        try:
            tree = stacks.tree(commit, pristine.commit)
        except NoStack as e:
            say(f"project commit {commit[:9]}: {e}; skipped")
            continue
        candidate = TreeSpec(BEFORE, f"project {commit[:9]}", tree, tuple(stacks.env.items()))
        if _timed_sources(source, candidate, files) != current:
            return candidate
    say(f"no tree {BEFORE!r}: none of the last {len(commits)} project commits that changed "
        f"patches/ has other sources for {', '.join(files)} and what they import")
    return None


def _timed_sources(source: Path, tree: TreeSpec, files: list[str]) -> dict[str, str]:
    """What the package would hold of `tree`: the files it has and the vllm
    modules they import."""
    tracked = _tracked_files(source, tree)
    return collect_modules(source, tree, tracked, [f for f in files if f in tracked])


def case_files(runner: Path, name: str) -> tuple[str, ...]:
    """The FILES a case module declares, read without importing it (no torch here)."""
    files = case_tuple(runner, name, "FILES")
    if files is None:
        raise StackError(f"{rel(runner / 'cases' / f'{name}.py')} must set FILES to a tuple "
                         f"of {_TUPLES['FILES']}")
    return files


_TUPLES = {"FILES": "vLLM file paths (see benchmarks/gpu/run.py)",
           "CSRC": "paths under the release's csrc/ (see scripts/perf/gpubench.py)",
           "AITER": "aiter module names (see scripts/perf/gpubench.py)"}


def case_tuple(runner: Path, name: str, variable: str) -> tuple[str, ...] | None:
    """A module-level tuple of strings of a case (FILES, CSRC, AITER), or None
    where the case does not set it."""
    path = runner / "cases" / f"{name}.py"
    if not path.is_file():
        raise StackError(f"no benchmark case {name!r}: expected {rel(path)} "
                         f"(cases: {', '.join(available_cases(runner)) or 'none'})")
    for node in ast.parse(path.read_text(), str(path)).body:
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target = node.target
        if isinstance(target, ast.Name) and target.id == variable:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                break
            if isinstance(value, tuple) and all(isinstance(f, str) for f in value):
                return value
            break
    else:
        return None
    raise StackError(f"{rel(path)} must set {variable} to a tuple of {_TUPLES[variable]}")


def build_package(runner: Path, source: Path, trees: list[TreeSpec], cases: list[str],
                  package: Path) -> None:
    """Write the package to `package` all at once (a temporary folder renamed)."""
    wanted = {name: case_files(runner, name) for name in cases}
    files_by_tree = {}
    for tree in trees:
        tracked = _tracked_files(source, tree)
        entries = [f for files in wanted.values() for f in files if f in tracked]
        files_by_tree[tree.label] = collect_modules(source, tree, tracked, entries)
    for name, files in wanted.items():
        for f in files:
            if not any(f in modules for modules in files_by_tree.values()):
                raise StackError(f"benchmark case {name!r}: {f} is in none of the trees ("
                                 + ", ".join(f"{t.label} = {t.rev}" for t in trees) + ")")
    csrc = sorted({f for name in cases for f in case_tuple(runner, name, "CSRC") or ()})
    aiter = sorted({m for name in cases for m in case_tuple(runner, name, "AITER") or ()})
    aiter_files, aiter_manifest = aiter_modules(aiter) if aiter else ({}, None)
    csrc_files = release_csrc(source, trees[0], csrc) if csrc else {}
    _refuse_foreign_folder(package)
    package.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gpubench-", dir=package.parent))
    try:
        for tree in trees:
            _write_tree(staging / "trees" / tree.label, files_by_tree[tree.label])
        for path, data in {**csrc_files, **aiter_files}.items():
            (staging / path).parent.mkdir(parents=True, exist_ok=True)
            (staging / path).write_bytes(data)
        for name in RUNNER_FILES:
            shutil.copy2(runner / name, staging / name)
        (staging / "cases").mkdir()
        for name in cases:
            shutil.copy2(runner / "cases" / f"{name}.py", staging / "cases")
        manifest = {"cases": cases, "source": str(source),
                    "trees": [t.manifest() for t in trees]}
        if csrc_files:
            manifest["csrc"] = {**trees[0].manifest(), "files": {
                path: _sha256(data) for path, data in sorted(csrc_files.items())}}
        if aiter_manifest:
            manifest["aiter"] = aiter_manifest
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        if size > MAX_PACKAGE_BYTES:
            raise StackError(f"the benchmark package would hold {size // 2**20} MiB, over "
                             f"{MAX_PACKAGE_BYTES // 2**20} MiB: a case's FILES import too much")
        old = None
        if package.exists():
            old = package.with_name(f"{staging.name}-old")
            os.replace(package, old)
        os.replace(staging, package)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def release_csrc(source: Path, tree: TreeSpec, paths: list[str]) -> dict[str, bytes]:
    """path -> bytes of the release's csrc/ files a case names (the
    `pristine` tree)."""
    out = {}
    for path in paths:
        clean = PurePosixPath(path)
        if clean.parts[:1] != ("csrc",) or ".." in clean.parts or clean.is_absolute():
            raise StackError(f"CSRC entry {path!r}: expected a file under csrc/ of vLLM")
        found = git(source, "cat-file", "-e", f"{tree.commit}:{path}", check=False,
                    env=dict(tree.git_env))
        if found.returncode != 0:
            raise StackError(f"CSRC entry {path}: not in tree {tree.label} ({tree.rev})")
        out[str(clean)] = git(source, "show", f"{tree.commit}:{path}", text=False,
                              env=dict(tree.git_env)).stdout
    return out


def aiter_folder() -> Path:
    """The installed aiter package folder, found without importing it (its
    __init__ needs ROCm)."""
    spec = _aiter_spec()
    if spec is None:
        raise StackError("a benchmark case names AITER modules, and this Python has no "
                         "amd-aiter installed: run gpubench with .venv/bin/python (its lock "
                         "pins amd-aiter), or leave that --case out")
    return Path(list(spec.submodule_search_locations)[0])


def _aiter_spec() -> importlib.machinery.ModuleSpec | None:
    """The installed aiter package's spec, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec("aiter")
    return spec if spec is not None and spec.submodule_search_locations else None


def aiter_modules(modules: list[str]) -> tuple[dict[str, bytes], dict]:
    """(path -> bytes, manifest entry) of the aiter modules and every aiter
    module they import, from the installed wheel; package __init__ files are
    written empty (aiter's own asks ROCm for its version and builds HIP ops)."""
    folder = aiter_folder()
    root = folder.parent
    installed = {p.relative_to(root).as_posix() for p in folder.rglob("*.py")}
    found: dict[str, bytes] = {}
    todo = [(m, m) for m in modules]
    while todo:
        module, chain = todo.pop()
        path = module_path(module, installed)
        if path is None:
            raise StackError(f"aiter module {module} ({chain}) is not in the installed "
                             f"amd-aiter ({folder})")
        if path in found or path.endswith("/__init__.py"):
            continue
        data = (root / path).read_bytes()
        found[path] = data
        for imported, names in package_imports(data.decode("utf-8"), _module_name(path),
                                               "aiter"):
            folder_only = module_path(imported, installed) is None and any(
                p.startswith(imported.replace(".", "/") + "/") for p in installed)
            if not folder_only:
                todo.append((imported, f"{chain} -> {imported}"))
            for name in names:
                if module_path(f"{imported}.{name}", installed) is not None:
                    todo.append((f"{imported}.{name}", f"{chain} -> {imported}.{name}"))
    files = dict(found)
    for path in list(found):
        for parent in PurePosixPath(path).parents:
            if str(parent) != ".":
                files.setdefault(f"{parent}/__init__.py", b"")
    try:
        version = importlib.metadata.version("amd-aiter")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    manifest = {"version": version, "folder": str(folder),
                "files": {path: _sha256(data) for path, data in sorted(found.items())}}
    return files, manifest


def _refuse_foreign_folder(package: Path) -> None:
    if package.exists() and not (package / MANIFEST).is_file():
        raise StackError(f"{package} exists and is not a benchmark package (no {MANIFEST}); "
                         "name another folder with --package, or remove it")


def _tracked_files(source: Path, tree: TreeSpec) -> set[str]:
    out = git(source, "ls-tree", "-r", "--name-only", tree.commit, "--", "vllm",
              env=dict(tree.git_env)).stdout
    return set(out.splitlines())


def _show(source: Path, tree: TreeSpec, path: str) -> str:
    data = git(source, "show", f"{tree.commit}:{path}", text=False,
               env=dict(tree.git_env)).stdout
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StackError(f"tree {tree.label} ({tree.rev}): {path} is not UTF-8 (byte "
                         f"{e.start}); Python source must be, so it cannot be benchmarked "
                         "at that revision")


def module_path(module: str, tracked: set[str]) -> str | None:
    """The file of a vllm module at a revision: a .py file or a package's __init__."""
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in tracked:
            return candidate
    return None


def collect_modules(source: Path, tree: TreeSpec, tracked: set[str],
                    entries: list[str]) -> dict[str, str]:
    """path -> source of the entry files and every vllm module they import,
    with the stand-ins in place of the modules named in STANDINS."""
    found: dict[str, str] = {}
    todo = [(path, path) for path in entries]  # (file, chain that led to it)
    while todo:
        path, chain = todo.pop()
        if path in found:
            continue
        text = _show(source, tree, path)
        found[path] = text
        if len(found) > MAX_MODULES_PER_TREE:
            raise StackError(
                f"tree {tree.label} ({tree.rev}): the files the benchmark cases call import "
                f"more than {MAX_MODULES_PER_TREE} vllm modules ({chain}); the package takes "
                "Triton kernel files with few vllm imports: give the heavy module a "
                "stand-in in scripts/perf/gpubench.py STANDINS")
        for module, names in vllm_imports(text, _module_name(path)):
            if module in STANDINS:
                _check_standin_use(tree, path, module, names, text)
                continue
            if any(module.startswith(f"{s}.") for s in STANDINS):
                raise StackError(f"tree {tree.label} ({tree.rev}): {path} imports {module}, "
                                 "which the benchmark's stand-ins do not provide; extend "
                                 "STANDINS in scripts/perf/gpubench.py")
            target = module_path(module, tracked)
            if target is None:
                raise StackError(f"tree {tree.label} ({tree.rev}): {path} imports {module}, "
                                 "which is not in the tree")
            todo.append((target, f"{chain} -> {target}"))
            for name in names:  # `from vllm.a import b` may name the module vllm.a.b
                submodule = module_path(f"{module}.{name}", tracked)
                if submodule is not None:
                    todo.append((submodule, f"{chain} -> {submodule}"))
    return found


def _module_name(path: str) -> str:
    parts = PurePosixPath(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _check_standin_use(tree: TreeSpec, path: str, module: str, names: tuple[str, ...],
                       text: str) -> None:
    standin = STANDINS[module]
    for name in names:
        if name not in standin.names:
            raise StackError(f"tree {tree.label} ({tree.rev}): {path} imports {name} from "
                             f"{module}; the benchmark's stand-in provides only "
                             f"{', '.join(sorted(standin.names))}: extend STANDINS in "
                             "scripts/perf/gpubench.py")
    for name, allowed in standin.attributes.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == name and node.attr not in allowed):
                raise StackError(f"tree {tree.label} ({tree.rev}): {path} uses "
                                 f"{name}.{node.attr}; the stand-in for {module} provides "
                                 f"{', '.join(sorted(allowed))}: extend STANDINS in "
                                 "scripts/perf/gpubench.py")


def vllm_imports(text: str, module: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, imported names) of every vllm import run when `module` is imported.

    Imports under `if TYPE_CHECKING:` are left out; relative imports are
    resolved against `module`.
    """
    return package_imports(text, module, "vllm")


def package_imports(text: str, module: str,
                    package: str) -> list[tuple[str, tuple[str, ...]]]:
    """vllm_imports for the modules of another top-level package."""
    out: list[tuple[str, tuple[str, ...]]] = []

    def inside(name: str) -> bool:
        return name == package or name.startswith(f"{package}.")

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # its imports run only when it is called
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.extend((a.name, ()) for a in node.names if inside(a.name))
            elif isinstance(node, ast.ImportFrom):
                name = _absolute(node, module)
                if inside(name):
                    out.append((name, tuple(a.name for a in node.names)))
            for block in _blocks(node):
                visit(block)

    visit(ast.parse(text).body)
    return out


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement (if, try, with, class)."""
    blocks = [getattr(node, field, []) for field in ("body", "orelse", "finalbody")]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    return [b for b in blocks if isinstance(b, list)]


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")[: -node.level] if node.level else []
    return ".".join([*package, node.module] if node.module else package)


def _write_tree(root: Path, modules: dict[str, str]) -> None:
    files = dict(modules)
    for name, standin in STANDINS.items():
        files[f"{name.replace('.', '/')}/__init__.py"] = standin.source
    for path in list(files):
        for parent in PurePosixPath(path).parents:
            if str(parent) != ".":
                files.setdefault(f"{parent}/__init__.py", "")
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _sees_a_gpu() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
