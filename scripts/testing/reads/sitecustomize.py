"""Read tracker of `make test` (scripts/testing/testdeps.py), loaded by every Python
process of a tracked test run through PYTHONPATH.

It appends to $K3_READS_LOG, one line per path, what the process reads
under the paths of $K3_READS_ROOT (the vLLM tree under test, and the
project's files that are no part of every key): `r <path>` a file it opens
(a module loaded from its cached bytecode counts as its source; a file a
reader in C or Rust opens by its path, _NATIVE_READERS, too), `l <path>`
a folder it lists, `s <path>` a path it stats, `k <path>` a path whose kind
alone it asks for (exists, is a file, a folder, a link), `i <folder>/<name>` a module
name the import system looks for in a folder (whatever the mechanism: an
import statement, importlib, a plugin scan), and `x <what>` what may read
the tree unseen: a write into it, or a subprocess that is neither Python
with this tracker, nor a `git show`/`git archive` of the pristine release
tag $K3_READS_BASE, nor one of the system probes below given no path in
the tree. `make test` computes its keys from these lines (scripts/testing/testdeps.py).
With K3_TESTS_PROFILE set it also starts k3_pertest.py (in this process only),
which records per test which of the tree's functions ran (scripts/testing/testblocks.py);
with K3_TESTS_CHILD set (a test's subprocess), k3_pertest records all this
process runs for that test.
"""

import functools
import os
import sys
import threading

# Programs that read no file they are not named (platform and library probes).
_PROBES = frozenset({"uname", "ldconfig", "file", "lscpu", "nproc", "hostname", "which",
                     "nvidia-smi", "rocm-smi", "amd-smi", "rocminfo", "openssl",
                     "gcc", "cc", "ld", "g++", "c++", "clang", "clang++", "nvcc", "hipcc",
                     "hipconfig", "ptxas"})
# Their short options whose value is a path (-I., -o out): -D, -l, -O, -W and
# the like name none.
_PATH_OPTIONS = ("-I", "-L", "-o", "-B", "-F", "-include", "-isystem", "-iquote", "-imacros")
# Readers in C, C++ or Rust that open a file by its path themselves, so that no
# `open` audit event tells of it: wrapped as their module is imported, each call
# records the path it is given (its first path argument, or one of _PATH_NAMES).
# One that cannot be wrapped makes the run unfollowable once its module is loaded.
_NATIVE_READERS = {
    "safetensors": ("safe_open",),  # which safetensors.torch/.numpy's load_file use
    "torch": ("from_file", "jit.load"),
    "tokenizers": ("Tokenizer.from_file",),
    "sentencepiece": ("SentencePieceProcessor.LoadFromFile",),
}
_PATH_NAMES = ("filename", "file", "path", "f", "model_file")


def switch_log(path: str) -> None:
    """From now on, record into `path` (a forked child of a fork server: each
    test file has its own log; the server's reads before the fork stay in its)."""
    raise RuntimeError("the read tracker is off: K3_READS_LOG and K3_READS_ROOT are unset")


def _install() -> None:
    global switch_log
    log = os.environ.get("K3_READS_LOG")
    roots = [r for r in os.environ.get("K3_READS_ROOT", "").split(os.pathsep) if r]
    if not log or not roots:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    both = {p for r in roots for p in (os.path.abspath(r), os.path.realpath(r))}
    prefixes = tuple(os.path.join(p, "") for p in both)
    base = os.environ.get("K3_READS_BASE", "")
    state = {"fd": os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)}
    seen: set = set()
    fspath, abspath, write = os.fspath, os.path.abspath, os.write

    def switch(path):
        os.close(state["fd"])
        state["fd"] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.environ["K3_READS_LOG"] = path  # for the subprocesses it starts

    switch_log = switch

    def note(kind, path):
        if (kind, path) in seen:
            return
        seen.add((kind, path))
        write(state["fd"], f"{kind} {path}\n".encode("utf-8", "surrogateescape"))

    def under_root(path):
        try:
            if isinstance(path, int):
                return None
            path = fspath(path)
            if isinstance(path, bytes):
                path = path.decode("utf-8", "surrogateescape")
            path = abspath(path)
        except (TypeError, ValueError):
            return None
        return path if path.startswith(prefixes) or path in both else None

    def source_of(path):
        head, name = os.path.split(path)
        folder, cache = os.path.split(head)
        if cache == "__pycache__" and name.endswith(".pyc"):
            return os.path.join(folder, name.split(".", 1)[0] + ".py")
        return path

    def on_open(args):
        path = under_root(args[0])
        if path is None:
            return
        mode, flags = args[1], args[2]
        writes = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR))
        if "__pycache__" in path.split(os.sep):
            if not writes:  # bytecode written for later runs is nothing read
                note("r", source_of(path))
        elif writes:
            note("x", f"writes {path}")
        else:
            note("r", path)

    importing = threading.local()  # inside the import system's own folder listing

    def on_list(args):
        if getattr(importing, "depth", 0):
            return  # what matters of it is which names were looked for: `i` lines
        path = under_root(args[0] if args[0] is not None else ".")
        if path is not None and not pytest_walk_to_named_files():
            note("l", path)

    def pytest_walk_to_named_files():
        """pytest lists each folder above the files it was given on its way to
        them and keeps only those: for a run of named files (no folder), the
        names beside them are read by nothing."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not hook.__code__:
            frame = frame.f_back
        caller = frame and frame.f_back  # what called os.scandir
        if caller is None or not caller.f_code.co_filename.endswith(
                os.path.join("_pytest", "pathlib.py")):
            return False
        collector = caller.f_back
        node = collector.f_locals.get("self") if collector is not None else None
        try:
            given = node.session._initialpaths if collector.f_code.co_name == "collect" else ()
            return bool(given) and all(p.is_file() for p in given)
        except AttributeError:
            return False

    def follows(executable, argv, env):
        """Whether a subprocess is Python that loads this tracker too."""
        program = os.path.basename(fspath(executable or (argv[0] if argv else "")))
        if not program.startswith("python"):
            return False
        env = os.environ if env is None else env
        if env.get("K3_READS_LOG") is None or here not in env.get("PYTHONPATH", "").split(
                os.pathsep):
            return False
        return not any(a in ("-I", "-S", "-E") or (a.startswith("-") and not a.startswith(
            "--") and any(c in a[1:] for c in "ISE")) for a in argv[1:2])

    def reads_base_only(argv):
        """`git -C <dir> show <base>:<path>` or `git -C <dir> archive ... <base> ...`:
        the pristine release, keyed as such."""
        words = [fspath(a) for a in argv]
        if not base or os.path.basename(words[0]) != "git":
            return False
        rest = words[1:]
        while rest and rest[0] == "-C":
            rest = rest[2:]
        if not rest or rest[0] not in ("show", "archive"):
            return False
        revs = [a for a in rest[1:] if not a.startswith("-")]
        if rest[0] == "show":
            return bool(revs) and all(a.startswith(base + ":") for a in revs)
        return bool(revs) and revs[0] == base

    def probe(argv):
        """A known probe given no path in the tree (an argument, or an option's
        value: `-I.`, `--include=dir`)."""
        if not argv or os.path.basename(fspath(argv[0])) not in _PROBES:
            return False
        paths = []
        words = list(map(str, argv[1:]))
        for i, arg in enumerate(words):
            if arg.startswith("--"):
                paths.append(arg.partition("=")[2])
            elif arg in _PATH_OPTIONS and i + 1 < len(words):
                paths.append(words[i + 1])  # `-o out`: the next word
            elif arg.startswith(_PATH_OPTIONS):
                paths.append(arg[len(next(o for o in _PATH_OPTIONS if arg.startswith(o))):])
            elif not arg.startswith("-") and not (i and words[i - 1] in _PATH_OPTIONS):
                # A word that looks like a path (`-x c++`, `sha512` are no paths).
                if "/" in arg or "." in arg or os.path.lexists(arg):
                    paths.append(arg)
        return not any(under_root(p) for p in paths if p)

    def on_popen(args):
        executable, argv, cwd, env = args
        argv = [argv] if isinstance(argv, (str, bytes)) else list(argv or [])
        if follows(executable, argv, env) or reads_base_only(argv) or probe(argv):
            return
        note("x", "runs " + " ".join(str(a) for a in argv)[:300])

    def on_exec(args):
        note("x", f"execs {args[0]}")

    handlers = {"open": on_open, "os.listdir": on_list, "os.scandir": on_list,
                "subprocess.Popen": on_popen, "os.posix_spawn": on_exec,
                "os.exec": on_exec, "os.spawn": on_exec}

    def hook(event, args):
        handler = handlers.get(event)
        if handler is not None:
            handler(args)

    probing = threading.local()  # inside a kind-only probe: its stat says no more

    def recorded(function, kind):
        def call(path, *args, **kwargs):
            if not getattr(probing, "depth", 0):
                where = under_root(path)
                if where is not None:
                    note(kind, where)
            if kind != "k":
                return function(path, *args, **kwargs)
            probing.depth = getattr(probing, "depth", 0) + 1
            try:
                return function(path, *args, **kwargs)
            finally:
                probing.depth -= 1

        call.__wrapped__ = function
        return call

    def reading(function):
        def call(*args, **kwargs):
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))][:1]
            for path in paths + [kwargs[k] for k in _PATH_NAMES if k in kwargs]:
                where = under_root(path)
                if where is not None:
                    note("r", where)
            return function(*args, **kwargs)

        return functools.update_wrapper(call, function)  # its name, its doc

    _track_module_lookups(under_root, note, importing)
    _follow_native_readers(reading, note)
    for module, name, kind in _PATH_FUNCTIONS:
        setattr(module, name, recorded(getattr(module, name), kind))
    sys.addaudithook(hook)
    if os.environ.pop("K3_TESTS_PROFILE", None):  # this process only: not its children
        os.environ.pop("K3_TESTS_CHILD", None)  # it records its own tests, for no one else
        import k3_pertest

        k3_pertest.start()
    elif os.environ.get("K3_TESTS_CHILD"):  # a test's subprocess: recorded for the test
        import k3_pertest

        k3_pertest.start_child()


def _follow_native_readers(reading, note) -> None:
    """Wrap each of _NATIVE_READERS with `reading` once its module has run (a
    finder first on sys.meta_path hands out the module's spec with its loader's
    exec_module extended)."""

    def wrap(module):
        for dotted in _NATIVE_READERS[module.__name__]:
            *outer, name = dotted.split(".")
            holder = module
            for part in outer:
                holder = getattr(holder, part, None)
            original = getattr(holder, name, None)
            if original is None:
                continue  # not in this version: nothing to read with
            wrapped = reading(original)
            if isinstance(holder, type) and getattr(original, "__self__", None) is holder:
                wrapped = staticmethod(wrapped)  # a classmethod, bound already
            try:
                setattr(holder, name, wrapped)
            except (AttributeError, TypeError):
                note("x", f"reads files unseen: {module.__name__}.{dotted}")

    class AfterImport:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname not in _NATIVE_READERS:
                return None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = None if finder is AfterImport or find is None else find(
                    fullname, path, target)
                if spec is not None and spec.loader is not None:
                    run = spec.loader.exec_module

                    def exec_module(module, run=run):
                        run(module)
                        wrap(module)

                    try:
                        spec.loader.exec_module = exec_module
                    except AttributeError:  # a loader that takes no attribute
                        note("x", f"reads files unseen: {fullname}")
                    return spec
            return None

    sys.meta_path.insert(0, AfterImport)


def _path_functions():
    """(where, name, kind) of each function that asks about a path without opening
    it: the stats (s: what a stat returns, size included) and the probes of a
    path's kind (k: exists, is a file, a folder, a link)."""
    import pathlib

    stats = [(os, "stat", "s"), (os, "lstat", "s"), (os, "access", "k")]
    kinds = [(os.path, name, "k") for name in ("exists", "lexists", "isfile", "isdir",
                                                 "islink")]
    kinds += [(pathlib.Path, name, "k") for name in ("exists", "is_file", "is_dir",
                                                      "is_symlink")]
    return stats + kinds


_PATH_FUNCTIONS = _path_functions()


def _track_module_lookups(under_root, note, importing) -> None:
    """Replace the path hook of the import system's FileFinder with one whose
    finders note each name looked up in a folder of the tree. (A listing of the
    folder would make every new file in it an input.)"""
    from importlib import _bootstrap_external, machinery

    class Finder(machinery.FileFinder):
        def find_spec(self, fullname, target=None):
            folder = under_root(self.path or ".")
            if folder is not None:
                note("i", os.path.join(folder, fullname.rpartition(".")[2]))
            return super().find_spec(fullname, target)

        def _fill_cache(self):
            importing.depth = getattr(importing, "depth", 0) + 1
            try:
                super()._fill_cache()
            finally:
                importing.depth -= 1

    for i, hook in enumerate(sys.path_hooks):
        if getattr(hook, "__qualname__", "").startswith("FileFinder.path_hook"):
            sys.path_hooks[i] = Finder.path_hook(
                *_bootstrap_external._get_supported_file_loaders())
            sys.path_importer_cache.clear()  # finders are made again, by the new hook
            return


_install()
