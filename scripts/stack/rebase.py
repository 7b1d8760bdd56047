"""`make rebase VLLM_VERSION=x.y.z`: move the stack onto another vLLM release.

`git rebase --onto` (with rerere) moves branch `rebase-<new>` onto the new release,
committed in build/vllm as a child of the old one. The state file's `rebase` entry
holds only what git cannot (the new pin, the release commit, the project's files'
digests, which git of ours runs); pin.toml, patches/ and vllm_overlay/ are written
once git is done.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from scripts.common import Layout, StackError, rel, say, write_atomically
from scripts.stack import apply, overlay
from scripts.stack.fetch import IndexUnreachable, ensure_artifact, find_in_index, index_needed
from scripts.stack.gitrepo import (
    BRANCH,
    TOOL_IDENTITY,
    commits_since,
    dirty_files,
    git,
    has_merges,
    head,
    import_release,
    is_stack_repo,
    read_state,
    rebase_in_progress,
    release_commit_id,
    remove_stale_git_locks,
    write_state,
)
from scripts.stack.pin import Artifact, Pin, check_version, load_pin, render_pin
from scripts.stack.series import (read_series, series_digest, series_names, series_text,
                                  touched_paths)

# A new release's files may be at most this many times the size of the pinned
# ones: their size comes from the index, which must not be able to fill the disk.
_MAX_GROWTH = 4
# What the finish writes, relative to the project root.
_PROJECT_FILES = ("pin.toml", "patches", "vllm_overlay")
# git's rebase runs without an editor; it comments out its notes on a conflict
# with core.commentChar, and "#" would strip a patch message's "## Purpose" too.
_GIT_REBASE_ENV = {"GIT_EDITOR": ":", "GIT_SEQUENCE_EDITOR": ":"}
_REBASE = ["-c", "core.commentChar=auto", "rebase"]
_REBASE_DIR = ".git/rebase-merge"  # git's rebase state, while a rebase is in progress


def rebase(layout: Layout, version: str) -> None:
    check_version(version, "VLLM_VERSION", "give a release, as in "
                  "`make rebase VLLM_VERSION=0.34.0`")
    if not is_stack_repo(layout.tree):
        raise StackError(f"{rel(layout.tree, layout)} does not exist; run `make apply` first")
    progress = _progress(layout)
    if progress and (progress["version"] != version or progress.get("git") == "abandon"):
        raise StackError(f"a rebase to vLLM {progress['version']} is in progress in "
                         f"{rel(layout.tree, layout)}: finish it with `make rebase VLLM_VERSION="
                         f"{progress['version']}`, or give it up with `make rebase-abandon` "
                         "(a killed `make rebase-abandon` is finished by running it again)")
    run = _Rebase(layout, progress or _start(layout, version))
    if progress and progress.get("finishing"):
        return run.complete_finish()
    if progress and progress.get("git"):
        run.recover_killed_git()
    run.check_branch()
    run.drive()
    run.finish()


def abandon(layout: Layout) -> None:
    """`make rebase-abandon`: back to branch `stack`. The rebase's commits (and a begun
    resolution) are kept as branch `abandoned-rebase-<version>`, its resolutions by rerere."""
    tree, where = layout.tree, rel(layout.tree, layout)
    if (version := rebase_in_progress(tree)) is None:
        raise StackError(f"no rebase is in progress in {where}: nothing to abandon")
    progress = read_state(tree).get("rebase")  # damaged, maybe: only the version is sure
    run = _Rebase(layout, {**(progress if isinstance(progress, dict) else {}), "version": version})
    if isinstance(run.progress.get("finishing"), dict):
        raise StackError(f"the rebase to vLLM {version} is being written into the project: "
                         f"complete it with `make rebase VLLM_VERSION={version}`")
    if run.progress.get("git"):
        remove_stale_git_locks(tree)  # our own git, killed
    if not run.unmerged():  # every conflict resolved and added: the next rebase reuses it
        git(tree, "rerere", check=False)
    kept = run.go_back(BRANCH, keep=True, mark="abandon")
    git(tree, "branch", "-q", "-D", run.branch, check=False)  # if there is one
    write_state(tree, rebase=None, status="applied")
    say(f"abandoned the rebase to vLLM {version}: {where} is back on branch {BRANCH}, pin.toml "
        "and patches/ unchanged" + (f"; its work is kept as branch {kept}" if kept else ""))


def _progress(layout: Layout) -> dict | None:
    """The state file's rebase entry, or None; one line if it is damaged."""
    progress = read_state(layout.tree).get("rebase")
    keys = {"version": str, "pin": dict, "old_branch": str, "release": str, "project": dict}
    if progress is None or isinstance(progress, dict) and all(
            isinstance(progress.get(k), t) for k, t in keys.items()):
        return progress
    raise StackError(f"{rel(layout.tree, layout)}/.git/k3-stack.json: its rebase entry is "
                     "damaged; give the rebase up with `make rebase-abandon` (git's own "
                     "state is kept as a branch), then start it again")


def _start(layout: Layout, version: str) -> dict:
    """Check that nothing would be lost, import the release, record the state."""
    old = load_pin(layout.pin_file)
    if version == old.version:
        raise StackError(f"the stack is already on vLLM {version} (pin.toml): nothing to do")
    tree, where, branch = layout.tree, rel(layout.tree, layout), f"rebase-{version}"
    apply.guard_tree(layout, "`make rebase`")
    old_base = read_state(tree)["base_tag"]
    # The finish replaces patches/: it must hold the stack, and nothing else edited.
    apply.refuse_overwriting_edits(layout, apply.rendered_stack(layout, old_base))
    # A rebase-<v> given up by hand may hold resolved patches no other branch has, which
    # a restart would reset. (--exclude: before --branches, without refs/heads/)
    if commits := git(tree, "rev-list", f"refs/heads/{branch}", "--not", f"--exclude={branch}",
                      "--branches", "--tags", check=False).stdout.split():
        raise StackError(
            f"branch {branch} in {where} holds {len(commits)} commit(s) of an earlier rebase "
            f"that no other branch has, and a new rebase would reset it: rename it (`git -C "
            f"{where} branch -m {branch} <name>`), then run `make rebase VLLM_VERSION={version}` "
            "again")
    new = pin_for(old, version)
    release = import_release(layout, new, ensure_artifact(layout, new.project, new.sdist),
                             parent=old_base)
    new = dataclasses.replace(new, commit=release_commit_id(tree, release) or "unknown")
    progress: dict = {"version": version, "pin": dataclasses.asdict(new), "release": release,
                "old_branch": f"{BRANCH}-{old.version}", "project": _project_digests(layout)}
    # Refs and settings only (git's rebase checks the branch out): done again after a kill.
    git(tree, "branch", "-f", progress["old_branch"], BRANCH)
    git(tree, "branch", "-f", branch, BRANCH)
    git(tree, "config", "rerere.enabled", "true")  # a recorded resolution is reused
    git(tree, "config", "rerere.autoUpdate", "true")
    write_state(tree, rebase=progress)
    say(f"rebasing {len(read_series(layout))} patch(es) from vLLM {old.version} onto "
        f"{version} with `git rebase` (old stack kept as branch {progress['old_branch']})")
    return progress


def pin_for(old: Pin, version: str) -> Pin:
    """The pin of `version`: same artifact kinds, sizes and hashes from the index."""
    def artifact(old_art: Artifact) -> Artifact:
        filename = old_art.filename.replace(old.version, version)
        try:
            found = find_in_index(old.project, filename)
        except IndexUnreachable as e:
            raise index_needed(f"look up vLLM {version}'s files and their sha256", e)
        if not (found.sha256 and found.size):
            problem = "no size/sha256"
        elif found.size > _MAX_GROWTH * old_art.size:
            problem = (f"{found.size / 1e6:.1f} MB, larger than {_MAX_GROWTH} times the "
                       f"pinned {old_art.filename}")
        else:
            return Artifact(filename, found.size, found.sha256)
        raise StackError(
            f"the index lists {filename} with {problem}: refusing to download it. If that "
            "is right, write the new pin.toml by hand and run `make apply`")

    return Pin(version, "unknown", f"vllm-{version}", artifact(old.sdist), artifact(old.wheel))


def _project_digests(layout: Layout) -> dict[str, str]:
    """sha256 of pin.toml and of each file under patches/ and vllm_overlay/."""
    tops = [layout.root / name for name in _PROJECT_FILES]
    paths = tops + [Path(d) / f for top in tops for d, _, files in os.walk(top) for f in files]
    return {p.relative_to(layout.root).as_posix(): digest for p in paths
            if (digest := apply.file_sha256(p))}


class _Rebase:
    """A rebase begun: build/vllm's git, and the state file's entry (`progress`)."""

    def __init__(self, layout: Layout, progress: dict):
        self.layout, self.tree, self.progress = layout, layout.tree, progress
        self.where, self.version = rel(layout.tree, layout), progress["version"]
        self.branch = f"rebase-{self.version}"
        self.again = f"then run `make rebase VLLM_VERSION={self.version}` again"

    def save(self, **changes) -> None:
        self.progress.update(changes)
        write_state(self.tree, rebase=self.progress)

    def rebasing(self) -> bool:
        return (self.tree / _REBASE_DIR).is_dir()

    def git_file(self, name: str) -> str:
        """A file of git's rebase state ("msgnum": the todo lines done), or ""."""
        path = self.tree / _REBASE_DIR / name
        return path.read_text().strip() if path.exists() else ""

    def listed(self, *args: str, **kwargs) -> list[str]:
        """The NUL-ended entries a `git ... -z` prints."""
        return git(self.tree, *args, **kwargs).stdout.split("\0")[:-1]

    def subject(self, rev: str) -> str:
        return git(self.tree, "log", "-1", "--format=%s", rev).stdout.strip()

    def unmerged(self) -> list[str]:
        return self.listed("diff", "--name-only", "-z", "--diff-filter=U")

    def stopped_pick(self) -> str:
        return git(self.tree, "rev-parse", "-q", "--verify", "REBASE_HEAD",
                   check=False).stdout.strip()

    def stopped_patch(self) -> str:
        pick = self.stopped_pick()
        return apply.patch_name(self.subject(pick)) if pick else "a patch"

    def check_branch(self) -> None:
        """Once git's rebase has begun, go on only on branch rebase-<v> or in git's
        rebase of it. (A moved tag does no harm: git is given the release's commit.)"""
        rebasing = self.git_file("head-name").removeprefix("refs/heads/")
        on = rebasing or git(self.tree, "symbolic-ref", "-q", "--short", "HEAD",
                             check=False).stdout.strip() or "a detached HEAD"
        if self.progress.get("begun") and on != self.branch:
            fix = "rebase --abort" if rebasing else f"checkout {self.branch}"
            raise StackError(f"{self.where} is {'rebasing' if rebasing else 'on'} {on}, not on "
                             f"branch {self.branch} where the rebase is: `git -C {self.where} "
                             f"{fix}`, {self.again} (or `make rebase-abandon`)")

    def drive(self) -> None:
        """Run git's rebase until it is done or stops for the user: start it, go on from
        a stop, fold `fixup!` commits made during it. A stop rerere resolved goes on."""
        tree, release, rebasing = self.tree, self.progress["release"], self.rebasing
        while True:
            before = self.git_file("msgnum")  # "" before git's rebase starts
            if rebasing():
                self.refuse_unfinished_stop()
                git(tree, "rerere", check=False)  # a kill inside git keeps the resolution
                args = ["--continue"]
            elif git(tree, "merge-base", "--is-ancestor", release, "HEAD",
                     check=False).returncode != 0:
                # The release's parent is the old base. git checks the branch out itself.
                args = ["--committer-date-is-author-date", "--onto", release, f"{release}^",
                        self.branch]
            elif fixups := [s for s in map(self.subject, commits_since(tree, release))
                            if s.startswith(("fixup! ", "squash! ", "amend! "))]:
                say(f"  folding into their patches: {', '.join(fixups)}")
                args = ["-i", "--autosquash", "--committer-date-is-author-date", release]
            else:
                return
            # Marked in the state file while git runs: the next run undoes a kill inside it.
            self.save(git=args[0], begun=True)
            result = git(tree, *_REBASE, *args, env=_GIT_REBASE_ENV, check=False)
            self.save(git=None)
            if rebasing() and (result.returncode == 0 or self.unmerged() or self.in_the_way()):
                raise self.stop()  # a conflict, or a stop git made for the user
            if rebasing() and self.git_file("msgnum") != before:
                # A new stop with nothing left unmerged: rerere resolved it all.
                say(f"  {self.stopped_patch()}: reused the recorded resolution of the conflict")
            elif result.returncode != 0:
                # git did not move (unstaged changes, a `git am` in progress): its own words.
                output = (result.stdout + result.stderr).strip().splitlines()
                raise StackError(
                    f"`git rebase {' '.join(args)}` stopped in {self.where}: " + " ".join(
                        [ln for ln in output if ln.startswith(("error:", "fatal:"))]
                        or output[-1:]) + f". Fix that there, {self.again}")

    def in_the_way(self) -> list[str] | None:
        """When git stopped before its pick merged anything (the pick is both the last line
        done and the next to do), the untracked files where the pick writes; else None."""
        done, todo = ([ln.split()[:2] for ln in self.git_file(name).splitlines()
                       if not ln.startswith("#")] for name in ("done", "git-rebase-todo"))
        if not (done and todo and done[-1] == todo[0] and (pick := self.stopped_pick())):
            return None
        paths = self.listed("diff-tree", "--no-commit-id", "--name-only", "-r", "-z", pick)
        return self.listed("ls-files", "--others", "-z", "--", *paths,
                           env={"GIT_LITERAL_PATHSPECS": "1"}) if paths else []

    def refuse_unfinished_stop(self) -> None:
        """Refuse what `git rebase --continue` would turn into a wrong patch."""
        tree, where = self.tree, self.where
        if self.in_the_way() is not None and git(tree, "diff", "--cached", "--quiet",
                                                 check=False).returncode != 0:
            raise StackError(
                f"git applied nothing of {self.stopped_patch()}, so what is staged in {where} "
                f"would be committed as that patch: unstage it (`git -C {where} restore "
                f"--staged .`), move files of yours out of {where}, {self.again}")
        stop, pick = self.progress.get("stop", {}), self.stopped_pick()
        if pick and stop.get("pick") == pick and stop["head"] != head(tree):
            made = git(tree, "log", "--format=%s", f"{stop['head']}..HEAD").stdout.splitlines()
            if self.subject(pick) not in made:
                raise StackError(
                    f"a commit made during the stop at {self.stopped_patch()} ({made[0]!r}) "
                    f"took that patch's resolution along, and git would count it as the patch: "
                    f"undo it keeping its changes (`git -C {where} reset --soft "
                    f"{stop['head'][:12]}`), {self.again}, and make the commit after the "
                    "patch is applied")

    def stop(self) -> StackError:
        """Record where git stopped (its pick, and HEAD to tell a commit made during the
        stop) and say what to do next."""
        where, version, release = self.where, self.version, self.progress["release"]
        self.save(stop={"pick": self.stopped_pick(), "head": head(self.tree)})
        end, patch = self.git_file("end"), self.stopped_patch()
        name = (f"[{self.git_file('msgnum')}/{end}] " if end else "") + patch
        skip, conflicted = f"`git -C {where} rebase --skip`", self.unmerged()
        deleted = [p for p in conflicted
                   if git(self.tree, "cat-file", "-e", f"{release}:{p}", check=False).returncode]
        if in_the_way := self.in_the_way():
            what = (f"{name}: untracked {', '.join(in_the_way)} in {where} stand where the "
                    f"patch writes, so git applied nothing of it. Move them out of {where} "
                    "(they are not the patch's: do not `git add` them)")
        elif deleted:
            what = (f"{name}: " + "; ".join(f"upstream deleted {p}" for p in deleted)
                    + f" in vLLM {version}, and {patch} changes it: drop the patch ({skip}), "
                    f"or re-home its change where the code went and `git -C {where} rm` the "
                    "file (resolving it as a conflict would bring the deleted file back)")
        elif conflicted:
            what = (f"{name} conflicts with vLLM {version} in: {', '.join(conflicted)}. Resolve "
                    f"them, then `git -C {where} add <files>` (or drop the patch: {skip})")
        else:
            what = (f"git stopped at {name}: see `git -C {where} status`; if upstream has "
                    f"the patch, drop it ({skip})")
        return StackError(
            f"{what}; {self.again} to go on. pin.toml and patches/ are unchanged and the "
            f"old stack is branch {self.progress['old_branch']}; to give up: `make "
            "rebase-abandon` (resolutions are recorded, a new `make rebase` reuses them)")

    def recover_killed_git(self) -> None:
        """The last run was killed inside its git (the state's mark says so; the project lock
        says none runs now): remove its locks and go back to branch rebase-<v>, keeping what a
        killed `--continue` had not committed; rerere replays what was recorded."""
        removed = remove_stale_git_locks(self.tree)
        kept = self.go_back(self.branch, keep=self.progress["git"] == "--continue")
        self.save(git=None)
        say(f"the last `make rebase` was killed inside git; undid what it half did in "
            f"{self.where}" + (f" (removed {', '.join(removed)})" if removed else "")
            + (f", its work tree kept as branch {kept}" if kept else "")
            + f": going on from branch {self.branch}")

    def go_back(self, target: str, keep: bool, mark: str | None = None) -> str | None:
        """Give git's rebase up and check `target` out by force, removing the untracked
        files that hold what git wrote (HEAD's or the release's blob at their path).
        Any other is the user's: refused where `target` has a file (the checkout would
        overwrite it). With `keep`, what the rebase did is kept as a branch, named."""
        tree, release = self.tree, self.progress.get("release")
        revs = [head(tree)] + ([release] if isinstance(release, str) else [])
        entries = [e.split("\t", 1) for r in revs for e in self.listed("ls-tree", "-r", "-z", r)]
        wrote = {(meta.split()[2], path) for meta, path in entries}  # (blob, path)
        untracked = self.listed("ls-files", "--others", "-z")  # ignored ones too
        blobs = git(tree, "hash-object", "--no-filters", "--stdin-paths", input="".join(
            f"{p}\n" for p in untracked)).stdout.split() if untracked else []
        ours = {p for p, blob in zip(untracked, blobs) if (blob, p) in wrote}
        at_target = self.listed("ls-tree", "-r", "-z", "--name-only", target)
        if yours := sorted(set(untracked).intersection(at_target) - ours):
            raise StackError(f"going back to branch {target} in {self.where} would overwrite "
                             f"untracked files of yours: {', '.join(yours[:5])}. Move them "
                             f"out of {self.where}, then run the same command again")
        if mark:
            self.save(git=mark)  # a kill from here: the same command finishes it
        kept = self.keep_work() if keep else None
        if self.rebasing() and git(tree, "rebase", "--abort", check=False).returncode != 0:
            git(tree, "rebase", "--quit")  # killed before its state was complete
        git(tree, "checkout", "-q", "-f", target)
        for path in ours.intersection(self.listed("ls-files", "--others", "-z")):
            (tree / path).unlink()
        return kept

    def keep_work(self) -> str | None:
        """Point a new branch at the rebase's commits, plus a commit of the work tree
        when it holds changes (a resolution begun); return its name."""
        tree, tip = self.tree, head(self.tree)
        index = tree / ".git" / "k3-keep-index"  # the work tree as a tree, via an index copy
        shutil.copyfile(tree / ".git" / "index", index)
        git(tree, "add", "-A", ".", env={"GIT_INDEX_FILE": str(index)})
        work = git(tree, "write-tree", env={"GIT_INDEX_FILE": str(index)}).stdout.strip()
        index.unlink()
        if work != git(tree, "rev-parse", f"{tip}^{{tree}}").stdout.strip():
            # The tool's identity as author too: a fresh machine may have none.
            author = {k.replace("COMMITTER", "AUTHOR"): v for k, v in TOOL_IDENTITY.items()}
            tip = git(tree, "commit-tree", work, "-p", tip, "-F", "-", env=author,
                      input=f"Unfinished resolution of {self.stopped_patch()} (rebase "
                      "abandoned)\n").stdout.strip()
        if tip == self.progress.get("release") or git(
                tree, "merge-base", "--is-ancestor", tip, BRANCH, check=False).returncode == 0:
            return None  # nothing was done on the new release
        name, n = f"abandoned-rebase-{self.version}", 1
        while git(tree, "rev-parse", "-q", "--verify", f"refs/heads/{name}",
                  check=False).returncode == 0:
            n += 1
            name = f"abandoned-rebase-{self.version}-{n}"
        git(tree, "branch", name, tip)
        return name

    def finish(self) -> None:
        """git is done: refuse what the finish would lose or get wrong, then write its
        journal (the rebased head, the files patches/ loses) and complete it."""
        tree, where, layout = self.tree, self.where, self.layout
        if dirty := dirty_files(tree):
            raise StackError(f"{where} has uncommitted changes ({', '.join(dirty[:5])}): "
                             f"commit them (`git -C {where} commit --fixup=<patch's commit>` "
                             f"folds them into it) or stash them, {self.again}")
        if has_merges(tree, self.progress["release"]):
            raise StackError(f"{where} has merge commits on {self.branch}; it must be linear")
        if edited := set(_project_digests(layout).items()) ^ set(self.progress["project"].items()):
            raise StackError(
                "changed since `make rebase` began: " + ", ".join(sorted({p for p, _ in edited}))
                + ". The finish replaces them: put them back (`git checkout -- <file>` in the "
                f"project), or give the rebase up with `make rebase-abandon`; {self.again}")
        rendered = apply.rendered_stack(layout, self.progress["release"])  # refused here if at all
        old_names = set(series_names(layout))
        for name in sorted(dropped := old_names - rendered.keys()):
            say(f"  dropped {name}: git's rebase left nothing of it (in upstream, or skipped)")
        notes = apply.notes_to_remove(layout, dropped, added=rendered.keys() - old_names)
        for note in notes:
            say(f"removed patches/{note}: its patch left the series (the project's git has it)")
        # From here the next run completes the finish: nothing before it changed the project.
        self.save(finishing={"head": head(tree), "remove": [*dropped, *notes]})
        self.complete_finish()

    def complete_finish(self) -> None:
        """Make the journal's head `stack` and write pin.toml, patches/ and vllm_overlay/ from
        it. Each step can be done again and replaces files whole: the next run completes it."""
        layout, tree, journal = self.layout, self.tree, self.progress["finishing"]
        release = self.progress["release"]
        git(tree, "checkout", "-q", "-B", BRANCH, journal["head"])
        git(tree, "branch", "-q", "-D", self.branch, check=False)  # gone after a kill
        d = self.progress["pin"]
        pin = Pin(**{**d, "sdist": Artifact(**d["sdist"]), "wheel": Artifact(**d["wheel"])})
        write_atomically(layout.pin_file, render_pin(pin).encode())
        rendered = apply.rendered_stack(layout, release)
        for name, content in rendered.items():
            write_atomically(layout.patches_dir / name, content)
        write_atomically(layout.series_file, series_text(list(rendered)))
        for name in journal["remove"]:
            (layout.patches_dir / name).unlink(missing_ok=True)
        overlay.write(layout, overlay.render(tree, pin, release, "HEAD", list(rendered)))
        write_state(tree, base_tag=pin.base_tag, base_sdist_sha256=pin.sdist.sha256,
                    base_commit=release, rebase=None, status="applied",
                    applied_head=journal["head"], applied_digest=series_digest(read_series(layout)),
                    synced=apply.patches_snapshot(layout), exporting=None)
        # A patch whose files upstream changed between the releases was really merged.
        changed = set(self.listed("diff", "--name-only", "-z", f"{release}^", release))
        review = [name for name, patch in rendered.items()
                  if changed.intersection(touched_paths(name, patch))]
        say(f"rebased onto vLLM {pin.version}; pin.toml, patches/ ({len(rendered)} patch(es)) "
            "and vllm_overlay/ updated"
            + (f"; upstream changed files these patches change, review them: {', '.join(review)}"
               if review else "")
            + ". Next: `make lock`, `make test`, then commit pin.toml, requirements/, patches/ "
            "and vllm_overlay/.")
