"""The code part of a stage's key: what in this package can change the stage's outputs.

A stage's code version hashes the source of its worker module and of every `verlflow.core` module it imports, directly or
through those modules (found by reading their import statements), except the plumbing modules below, plus an
explicit version number per stage. So:

- a fix in the CLI, a backend, the runner, the launcher or the store leaves every key as it was: a run committed by
  the previous release resumes after `pip install -U verlflow`;
- a change to the code a stage computes with (model, ppo, packing, checkpoint, data, rewards, rollout, generate,
  fastgen, the stage file, the seeding in stages/common) changes that stage's key, and through its key the keys of
  every stage that reads it; comments and docstrings are not part of the hash;
- a spec's `version` (core/stagespec.py) is for what the hash cannot see: a change of behaviour outside the hashed sources (a dependency's
  maths, the format a plumbing module writes). Bump the stage's number and every committed stage of that kind,
  and all after it, runs again.
"""

import ast
import functools
import hashlib
import io
import threading
import time
import tokenize
from pathlib import Path

PACKAGE = "verlflow.core"


# Modules a worker imports that move bytes or report, never compute outputs: their edits keep every key (among
# them the compile-time report, the cache folder's name, retention's pruning and the file digests). The
# blueprint's *values* are in the key through its sections; the store verifies every file by its checksum; faults
# are inert unless asked for; the job spec is the runner -> worker message.
# The rooms' own __init__ files (docstrings only) are plumbing too: importing `model` from `ml` must not pull in
# every module of `ml`.
PLUMBING = frozenset({PACKAGE} | {f"{PACKAGE}.{m}" for m in (
    "orchestrate", "store", "ml", "testing", "checks",
    "blueprint", "blueprint.sections", "blueprint.blueprint", "blueprint.load",
    "errors", "job", "store.artifacts", "faults",
    "orchestrate.pool", "orchestrate.devices", "stages", "agree",
    "ml.compiletime", "cachedir", "store.retention", "store.digests",
    "store.promote", "store.chain", "stagespec")})  # pointers move after a commit: not what a stage computes
# And every module of the stages' runtime (context, models from memory, writes and commits, the serve loop): models
# it takes from memory equal a load (bit-identical, tested); the loads themselves are core/stages/loads.py, hashed.
RUNTIME = f"{PACKAGE}.stages.runtime"


def is_plumbing(module: str) -> bool:
    return module in PLUMBING or module == RUNTIME or module.startswith(RUNTIME + ".")


def stage_code_versions(root: Path | None = None) -> dict[str, str]:
    """{stage: code version} for the package at `root` (default: this one)."""
    root = root or Path(__file__).parents[1]
    from verlflow.core.stagespec import SPECS

    return {name: _version(root, name, s.version) for name, s in SPECS.items()}


def stage_modules(root: Path, stage: str) -> list[str]:
    """The hashed modules of a stage: its worker and the non-plumbing `verlflow.core` modules it imports, transitively."""
    seen, todo = set(), [f"{PACKAGE}.stages.{stage}"]
    while todo:
        name = todo.pop()
        if name in seen or is_plumbing(name) or _file(root, name) is None:
            continue
        seen.add(name)
        todo += _imports(root, name) + _submodules(root, name)
    return sorted(seen)


def _submodules(root: Path, module: str) -> list[str]:
    """A package's own modules: a package may load them lazily (verlflow.core.ml.fastgen), out of the import statements' sight."""
    f = _file(root, module)
    if f.name != "__init__.py":
        return []
    return [f"{module}.{p.stem}" for p in sorted(f.parent.glob("*.py")) if p.name != "__init__.py"]


def _version(root: Path, stage: str, number: int) -> str:
    h = hashlib.sha256(f"{stage}/{number}".encode())
    for name in stage_modules(root, stage):
        h.update(b"\0" + name.encode() + b"\0" + _code_text(_file(root, name)).encode())
    return h.hexdigest()[:16]


def _file(root: Path, module: str) -> Path | None:
    """The source file of a module of this package (a package's __init__.py), or None."""
    parts = module.removeprefix(PACKAGE).lstrip(".").split(".") if module != PACKAGE else []
    base = root.joinpath(*parts)
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


_PARSE = threading.Lock()


def _parse(text: str) -> ast.Module:
    """ast.parse, again after CPython 3.11's spurious "AST constructor recursion depth mismatch": the AST state is
    shared by the interpreter's threads (python/cpython#106905), and a Prefect flow-run process has threads of its
    own that parse (a scheduled run on a process worker failed so in CI once)."""
    for _ in range(4):
        try:
            with _PARSE:
                return ast.parse(text)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
            time.sleep(0.01)
    with _PARSE:
        return ast.parse(text)


def _imports(root: Path, module: str) -> list[str]:
    """Modules of this package that `module` imports anywhere in its body (function-level imports too)."""
    f = _file(root, module)
    package = module if f.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _import_statements(f.read_text(encoding="utf-8")):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names]  # `from core import model` names a module
    return [m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


# Every stage's walk meets the same ~50 modules: each text is parsed and cut once, not ~9 times (15 s -> 2 s).
@functools.lru_cache(maxsize=1024)
def _import_statements(text: str) -> tuple[ast.stmt, ...]:
    return tuple(n for n in ast.walk(_parse(text)) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _code_text(path: Path) -> str:
    return _without_comments(path.read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1024)
def _without_comments(text: str) -> str:
    """The source without comments, docstrings (bare string statements) and blank lines: an edit of those changes
    no output. Cut from the text itself, so the result is the same under every Python version."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def offset(pos: tuple[int, int]) -> int:
        return starts[pos[0] - 1] + pos[1]

    cuts, statement = [], []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            cuts.append((offset(tok.start), offset(tok.end)))
        elif tok.type == tokenize.NEWLINE:
            if len(statement) == 1 and statement[0].type == tokenize.STRING:
                cuts.append((offset(statement[0].start), offset(statement[0].end)))
            statement = []
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            statement.append(tok)
    kept, at = [], 0
    for a, b in cuts:
        kept.append(text[at:a])
        at = b
    kept.append(text[at:])
    return "\n".join(line.rstrip() for line in "".join(kept).splitlines() if line.strip())
