"""Feature discovery: which definitions exist, which tests exercise them, what they drag along.

Pure functions over file texts (`ast` spans) and a per-test coverage map
(file -> line -> test ids, from coverage.py with the test id as dynamic context).
A feature is a public top-level function or class plus the private helpers only it uses;
its tests are those that execute its body or name it in their code.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from cadenza.tasks.source import is_test_file

Coverage = dict[str, dict[int, list[str]]]


@dataclass
class Definition:
    file: str
    name: str
    kind: str  # "function" | "class"
    start: int  # first line, decorators included (1-based)
    end: int  # last line (inclusive)
    body_lines: frozenset[int]  # lines that run only when the definition is used
    refs: frozenset[str]  # identifiers it mentions (names and attributes)
    signature: str
    docstring: str | None


@dataclass
class Feature:
    name: str
    file: str
    module: str
    kind: str  # "function" | "class" | "module"
    defs: list[Definition]  # the feature first, then its exclusive private helpers (a module: all)
    tests: set[str]  # ids of passing tests that execute its body
    callers: list[str] = field(default_factory=list)  # other definitions that mention it
    centrality: float = 0.0  # callers / definitions in the project

    @property
    def names(self) -> set[str]:
        return {d.name for d in self.defs}

    @property
    def lines(self) -> int:
        return sum(d.end - d.start + 1 for d in self.defs)

    @property
    def files_removed(self) -> int:
        return 1 if self.kind == "module" else 0


def module_name(rel: str, root: str = ".") -> str:
    parts = list(PurePosixPath(rel).with_suffix("").parts)
    if root != "." and parts and parts[0] == root:
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _identifiers(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _body_lines(body: list[ast.stmt]) -> set[int]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring is not executed code
    lines: set[int] = set()
    for stmt in body:
        lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
        init = next(
            (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
        )
        head = f"class {node.name}({bases})" if bases else f"class {node.name}"
        return head + (f"  # {_signature(init)}" if init else "")
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){ret}"


def definitions(rel: str, text: str) -> list[Definition]:
    """Top-level functions and classes of a module, with exact spans."""
    out = []
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if isinstance(node, ast.ClassDef):
            body: set[int] = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    body |= _body_lines(sub.body)
            kind = "class"
        else:
            body, kind = _body_lines(node.body), "function"
        out.append(
            Definition(
                rel,
                node.name,
                kind,
                start,
                node.end_lineno,
                frozenset(body),
                frozenset(_identifiers(node)),
                _signature(node),
                ast.get_docstring(node),
            )
        )
    return out


def _word_count(text: str, name: str) -> int:
    return len(re.findall(rf"(?<![\w.]){re.escape(name)}\b", text)) + len(
        re.findall(rf"\.{re.escape(name)}\b", text)
    )


def exclusive_helpers(
    feature: Definition, defs: list[Definition], texts: dict[str, str]
) -> list[Definition]:
    """Private definitions of the same module used by the feature and by nothing else.

    A helper h joins when every mention of h in the whole project lies inside the feature,
    inside helpers already taken, or inside h itself (fixpoint, so helpers of helpers too).
    """
    lines = texts[feature.file].splitlines()
    taken = [feature]
    private = [d for d in defs if d.name.startswith("_") and not d.name.startswith("__")]
    changed = True
    while changed:
        changed = False
        used = set().union(*(d.refs for d in taken))
        for h in private:
            if h in taken or h.name not in used:
                continue
            spans = [(d.start, d.end) for d in taken + [h]]
            outside = "\n".join(
                line for i, line in enumerate(lines, 1) if not any(a <= i <= b for a, b in spans)
            )
            if _word_count(outside, h.name):
                continue
            if any(_word_count(t, h.name) for f, t in texts.items() if f != feature.file):
                continue
            taken.append(h)
            changed = True
    return taken[1:]


def find_features(
    texts: dict[str, str],
    library: list[str],
    coverage: Coverage,
    passing: set[str],
    root: str = ".",
) -> list[Feature]:
    """Candidate features: public top-level definitions executed by at least one passing test."""
    all_defs = {rel: definitions(rel, texts[rel]) for rel in library}
    n_defs = sum(len(v) for v in all_defs.values()) or 1
    # removal is by name across modules, so a name defined in two modules is ambiguous
    defined: dict[str, int] = {}
    for ds in all_defs.values():
        for d in ds:
            defined[d.name] = defined.get(d.name, 0) + 1
    features = []
    for rel, defs in all_defs.items():
        names = [d.name for d in defs]
        lines_cov = coverage.get(rel, {})
        for d in defs:
            if d.name.startswith("_") or names.count(d.name) > 1 or defined[d.name] > 1:
                continue
            helpers = exclusive_helpers(d, defs, texts)
            tests = set()
            for part in [d, *helpers]:
                for ln in part.body_lines:
                    tests.update(t for t in lines_cov.get(ln, ()) if t in passing)
            tests = {t for t in tests if is_test_file(t.split("::")[0])}
            if not tests:
                continue
            callers = sorted(
                f"{module_name(r, root)}.{o.name}"
                for r, ds in all_defs.items()
                for o in ds
                if o is not d and o not in helpers and d.name in o.refs
            )
            features.append(
                Feature(
                    d.name,
                    rel,
                    module_name(rel, root),
                    d.kind,
                    [d, *helpers],
                    tests,
                    callers,
                    len(callers) / n_defs,
                )
            )
    return features


def find_module_features(
    texts: dict[str, str],
    library: list[str],
    coverage: Coverage,
    passing: set[str],
    root: str = ".",
) -> list[Feature]:
    """Candidate whole-module features: a non-package module with definitions, all of whose
    names are unique in the project, executed by at least one passing test."""
    all_defs = {rel: definitions(rel, texts[rel]) for rel in library}
    n_mods = len(library) or 1
    defined: dict[str, int] = {}
    for ds in all_defs.values():
        for d in ds:
            defined[d.name] = defined.get(d.name, 0) + 1
    features = []
    for rel, defs in all_defs.items():
        if rel.endswith("__init__.py") or not defs or any(defined[d.name] > 1 for d in defs):
            continue
        mod = module_name(rel, root)
        lines_cov = coverage.get(rel, {})
        tests = {
            t
            for d in defs
            for ln in d.body_lines
            for t in lines_cov.get(ln, ())
            if t in passing and is_test_file(t.split("::")[0])
        }
        if not tests:
            continue
        last = mod.rpartition(".")[2]
        importers = sorted(
            module_name(r, root)
            for r in library
            if r != rel
            and re.search(
                rf"\b(import\s+{re.escape(last)}\b|\.{re.escape(last)}\s+import)", texts[r]
            )
        )
        features.append(
            Feature(last, rel, mod, "module", defs, tests, importers, len(importers) / n_mods)
        )
    return features


def test_key(nodeid: str) -> tuple[str, ...]:
    """(file, class..., function) of a test id, parameters dropped."""
    parts = nodeid.split("::")
    parts[-1] = parts[-1].split("[")[0]
    return tuple(parts)


def tests_naming(
    texts: dict[str, str], test_files: list[str], names: set[str]
) -> tuple[set[tuple[str, ...]], set[str]]:
    """Test functions whose code mentions one of names, and test files that mention them at
    module level outside imports (every test of such a file depends on the names)."""
    keys: set[tuple[str, ...]] = set()
    whole: set[str] = set()

    def visit(rel: str, body: list[ast.stmt], prefix: tuple[str, ...]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _identifiers(node) & names:
                    keys.add((rel, *prefix, node.name))
            elif isinstance(node, ast.ClassDef):
                visit(rel, node.body, (*prefix, node.name))

    for rel in test_files:
        tree = ast.parse(texts[rel])
        visit(rel, tree.body, ())
        for node in tree.body:
            if isinstance(
                node,
                ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
            ):
                continue
            if _identifiers(node) & names:
                whole.add(rel)
    return keys, whole
