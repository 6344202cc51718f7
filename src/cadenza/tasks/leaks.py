"""Leak scan: is any trace of the removed code left in a workspace or its environment?

What counts as a trace of a removed definition:
- a definition of its name (`def NAME`, `class NAME`) in any text file;
- a private helper's name anywhere (nothing else uses it, by construction);
- its dotted name (`pkg.mod.NAME`) in a non-Python file (type-checker caches, stubs, indexes);
- a run of consecutive distinctive source lines (blank and comment lines aside) matching
  its body in order: all of a short body, else at least max(3, half) of its lines;
- a code object with its qualified name from its module, in any .pyc (marshal-decoded);
- a removed file's path in a listing (egg-info SOURCES.txt, RECORD);
- git objects are decompressed and scanned like files.
"""

from __future__ import annotations

import ast
import importlib.util
import marshal
import re
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from cadenza.tasks.discover import Definition

MIN_LINE = 12  # shorter lines are too generic to fingerprint


@dataclass
class Secret:
    """What must not be recoverable from a task's workspace."""

    names: set[str]  # all removed definition names
    private: set[str]  # removed private helper names
    dotted: set[str]  # "pkg.mod.name"
    module_file: str  # "pkg/mod.py": where the code objects came from
    fingerprints: list[list[str]] = field(default_factory=list)  # per definition, in order
    removed_files: set[str] = field(default_factory=set)


def _docstring_lines(node: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.update(range(first.lineno, first.end_lineno + 1))
    return out


def secret_for(
    defs: list[Definition], text: str, module: str, removed_files: set[str] = frozenset()
) -> Secret:
    lines = text.splitlines()
    tree = ast.parse(text)
    doc = _docstring_lines(tree)
    fps = []
    for d in defs:
        seq = []
        for i in range(d.start, d.end + 1):
            s = lines[i - 1].strip()
            if i not in doc and s and not s.startswith("#"):
                seq.append(s)
        if sum(len(x) >= MIN_LINE for x in seq) >= 2:
            fps.append(seq)
    names = {d.name for d in defs}
    return Secret(
        names=names,
        private={n for n in names if n.startswith("_")},
        dotted={f"{module}.{n}" for n in names},
        module_file=defs[0].file,
        fingerprints=fps,
        removed_files=set(removed_files),
    )


def _code_objects(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def scan_pyc(data: bytes, secret: Secret) -> str | None:
    if not any(n.encode() in data for n in secret.names):
        return None
    if data[:4] != importlib.util.MAGIC_NUMBER:
        return "bytecode of another Python version names a removed definition"
    try:
        code = marshal.loads(data[16:])
    except (ValueError, EOFError, TypeError):
        return "undecodable bytecode names a removed definition"
    for c in _code_objects(code):
        qual = getattr(c, "co_qualname", c.co_name)
        if qual.split(".")[0] in secret.names and c.co_filename.endswith(secret.module_file):
            return f"bytecode contains the compiled {qual} from {secret.module_file}"
    return None


def scan_text(text: str, rel: str, secret: Secret, *, by_name: bool = True) -> str | None:
    """by_name: names alone count (the workspace); off for third-party code in an
    environment, where another package may well define a function of the same name."""
    indent = "" if rel.endswith(".py") else r"\s*"  # nested same-name methods are not copies
    for n in secret.names if by_name else ():
        if re.search(rf"^{indent}(async\s+def|def|class)\s+{re.escape(n)}\b", text, re.M):
            return f"defines removed {n}"
    for n in secret.private if by_name else ():
        if re.search(rf"\b{re.escape(n)}\b", text):
            return f"mentions removed private helper {n}"
    if not rel.endswith(".py"):
        for d in secret.dotted:
            if d in text:
                return f"mentions {d}"
        for f in secret.removed_files:
            if f in text:
                return f"lists removed file {f}"
    if secret.fingerprints:
        significant = [
            x for x in (line.strip() for line in text.splitlines()) if x and not x.startswith("#")
        ]
        for seq in secret.fingerprints:
            run = longest_common_run(significant, seq)
            if run >= min(len(seq), max(3, len(seq) // 2)):
                return f"contains {run} consecutive lines of the removed code"
    return None


def longest_common_run(a: list[str], b: list[str]) -> int:
    """Length of the longest run a[i:i+k] == b[j:j+k] (dynamic programming over matches)."""
    where: dict[str, list[int]] = {}
    for j, x in enumerate(b):
        where.setdefault(x, []).append(j)
    best = 0
    prev: dict[int, int] = {}
    for x in a:
        cur = {j: prev.get(j - 1, 0) + 1 for j in where.get(x, ())}
        if cur:
            best = max(best, max(cur.values()))
        prev = cur
    return best


def _git_object(data: bytes) -> bytes:
    """A loose git object's content (blobs only; trees and commits are not source)."""
    try:
        raw = zlib.decompress(data)
    except zlib.error:
        return data
    header, _, body = raw.partition(b"\0")
    return body if header.startswith(b"blob ") else b""


def scan_tree(
    root: Path, secret: Secret, skip: set[str] = frozenset(), *, env: bool = False
) -> list[str]:
    """Findings ("path: reason") for every file under root (git objects decompressed).

    env: root is an environment, where any file at the module's own path is an installed copy.
    """
    needles = {x.encode() for x in secret.names | secret.dotted | secret.removed_files}
    needles |= {line.encode() for seq in secret.fingerprints for line in seq}
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        if env and (rel == secret.module_file or rel.endswith("/" + secret.module_file)):
            found.append(f"{rel}: an installed copy of {secret.module_file}")
            continue
        data = path.read_bytes()
        if rel.startswith(".git/objects/"):
            data = _git_object(data)
        if not any(n in data for n in needles):  # every check needs one of these substrings
            continue
        if path.suffix in (".pyc", ".pyo"):
            why = scan_pyc(data, secret)
        elif b"\0" in data[:8192]:
            why = None
        else:
            why = scan_text(data.decode("utf-8", "replace"), rel, secret, by_name=not env)
        if why:
            found.append(f"{rel}: {why}")
    return found
