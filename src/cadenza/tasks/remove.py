"""Feature removal on exact `ast` source spans: definitions, re-exports, hidden tests.

Pure functions from file texts to new file texts (None = the file is deleted). Whole
statements are deleted by line span (with the comment block directly above them), and the
blank lines around a hole are collapsed to what was there before, so the rest of the file is
byte-identical. Import and `__all__` statements that name removed symbols are regenerated
with those names dropped.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from cadenza.tasks.discover import Definition, test_key


class RemovalError(ValueError):
    """A span that cannot be deleted exactly (e.g. a statement sharing its line)."""


def _stmt_alone(lines: list[str], node: ast.stmt) -> bool:
    before = lines[node.lineno - 1][: node.col_offset]
    after = lines[node.end_lineno - 1][node.end_col_offset :].strip()
    return not before.strip() and (not after or after.startswith("#"))


def delete_spans(text: str, spans: Iterable[tuple[int, int]]) -> str:
    """Delete 1-based inclusive line spans, plus comment lines directly above each span."""
    lines = text.splitlines(keepends=True)
    drop = set()
    for start, end in spans:
        while start > 1 and lines[start - 2].lstrip().startswith("#"):
            start -= 1
        drop.update(range(start, end + 1))
    out: list[str] = []
    i = 1
    while i <= len(lines):
        if i not in drop:
            out.append(lines[i - 1])
            i += 1
            continue
        while i <= len(lines) and i in drop:
            i += 1
        # keep as many blank lines at the hole as the larger side had, not their sum
        blanks_before = 0
        while blanks_before < len(out) and not out[-1 - blanks_before].strip():
            blanks_before += 1
        j = i
        while j <= len(lines) and j not in drop and not lines[j - 1].strip():
            j += 1
        blanks_after = j - i
        keep_after = max(0, blanks_after - blanks_before) if j <= len(lines) else 0
        if not out or out[-1].rstrip().endswith(":"):  # file start or block opener: no blank
            keep_after = 0
        if j > len(lines):  # hole at the end of the file: no trailing blank lines
            while out and not out[-1].strip():
                out.pop()
        i = j - keep_after
    return "".join(out)


def _replace_stmt(lines: list[str], node: ast.stmt, new: ast.stmt | None) -> None:
    indent = lines[node.lineno - 1][: node.col_offset]
    text = "" if new is None else indent + ast.unparse(new).replace("\n", "\n" + indent) + "\n"
    lines[node.lineno - 1 : node.end_lineno] = [text] + [""] * (node.end_lineno - node.lineno)


def _statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Module-level statements, looking inside if/try blocks (conditional imports)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, getattr(node, "finalbody", [])):
                yield from _statements(block)
            for h in getattr(node, "handlers", []):
                yield from _statements(h.body)


def _all_strings(node: ast.AST) -> bool:
    return isinstance(node, ast.List | ast.Tuple) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    )


def _sets_attribute_of(node: ast.stmt, names: set[str]) -> bool:
    targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
    for t in targets:
        while isinstance(t, ast.Attribute | ast.Subscript):
            t = t.value
            if isinstance(t, ast.Name) and t.id in names:
                return True
    return False


def drop_references(text: str, names: set[str], *, aliases: bool = True) -> tuple[str, set[str]]:
    """Drop names from from-imports and `__all__`; delete module-level aliases of them.

    Statements setting an attribute or item of a removed name go too. An alias is
    `x = <expr naming a removed name>` at module level (e.g. `comp = compose`,
    `groupby = curry(toolz.groupby)`); its target is removed too and returned, so callers can
    treat it as part of the feature. Returns (new text, names removed in this file).
    """
    names = set(names)
    removed: set[str] = set()
    changed = True
    while changed:
        changed = False
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        edits: list[tuple[ast.stmt, ast.stmt | None]] = []
        for node in _statements(tree.body):
            if aliases and _sets_attribute_of(node, names):  # e.g. `f.__doc__ = ...`
                edits.append((node, None))
            elif isinstance(node, ast.ImportFrom) and node.names[0].name != "*":
                keep = [
                    a
                    for a in node.names
                    if a.name not in names and (a.asname or a.name) not in names
                ]
                if len(keep) < len(node.names):
                    removed |= {a.asname or a.name for a in node.names if a not in keep}
                    new = ast.ImportFrom(module=node.module, names=keep, level=node.level)
                    edits.append((node, new if keep else None))
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and isinstance(
                getattr(node, "target", None) or node.targets[0], ast.Name
            ):
                target = (getattr(node, "target", None) or node.targets[0]).id
                value = node.value
                if target == "__all__" and value is not None and _all_strings(value):
                    keep = [e for e in value.elts if e.value not in names]
                    if len(keep) < len(value.elts):
                        new = ast.parse(ast.unparse(node)).body[0]
                        new.value.elts = keep  # type: ignore[union-attr]
                        edits.append((node, new))
                elif (
                    aliases
                    and isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and value is not None
                    and (
                        {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
                        | {n.attr for n in ast.walk(value) if isinstance(n, ast.Attribute)}
                    )
                    & names
                ):
                    edits.append((node, None))
                    names.add(target)
                    removed.add(target)
        if not edits:
            break
        for node, _ in edits:
            if not _stmt_alone(lines, node):
                raise RemovalError(
                    f"line {node.lineno}: statement shares its line; cannot edit exactly"
                )
        deletions = [(n.lineno, n.end_lineno) for n, new in edits if new is None]
        for node, new in sorted(edits, key=lambda e: -e[0].lineno):
            if new is not None:
                _replace_stmt(lines, node, new)
        text = delete_spans("".join(lines), deletions)
        changed = True
    return text, removed


def resolve_import(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names, seen from module `importer`."""
    if not node.level:
        return node.module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(base + ([node.module] if node.module else []))


def drop_module_imports(
    text: str, importer: str, is_package: bool, module: str, public: set[str]
) -> tuple[str, set[str]]:
    """Delete imports of a removed module (`from .m import *`, `from .m import a`,
    `from . import m`); returns (new text, names that were bound by them)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    parent, _, last = module.rpartition(".")
    edits: list[tuple[ast.stmt, ast.stmt | None]] = []
    bound: set[str] = set()
    for node in _statements(tree.body):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = resolve_import(importer, is_package, node)
        if target == module:
            for a in node.names:
                bound |= public if a.name == "*" else {a.asname or a.name}
            edits.append((node, None))
        elif target == parent and any(a.name == last for a in node.names):
            keep = [a for a in node.names if a.name != last]
            bound.add(last)
            edits.append(
                (
                    node,
                    ast.ImportFrom(module=node.module, names=keep, level=node.level)
                    if keep
                    else None,
                )
            )
    for node, _ in edits:
        if not _stmt_alone(lines, node):
            raise RemovalError(f"line {node.lineno}: import shares its line; cannot edit exactly")
    for node, new in sorted(edits, key=lambda e: -e[0].lineno):
        if new is not None:
            _replace_stmt(lines, node, new)
    return delete_spans(
        "".join(lines), [(n.lineno, n.end_lineno) for n, new in edits if new is None]
    ), bound


def remove_definitions(text: str, defs: list[Definition]) -> str:
    """Delete top-level definitions (exact spans, decorators and leading comments included)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    by_start = {
        min([n.lineno] + [d.lineno for d in n.decorator_list]): n
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    for d in defs:
        node = by_start.get(d.start)
        if node is None or node.name != d.name:
            raise RemovalError(f"{d.file}:{d.start}: expected definition of {d.name}")
        if not _stmt_alone(lines, node):
            raise RemovalError(
                f"{d.file}:{d.start}: {d.name} shares its line; cannot delete exactly"
            )
    return delete_spans(text, [(d.start, d.end) for d in defs])


def remove_tests(rel: str, text: str, hidden: set[tuple[str, ...]]) -> str | None:
    """Delete hidden test functions (keys from `test_key`); None when no test is left.

    A class whose test methods are all hidden goes as a whole.
    """
    tree = ast.parse(text)
    spans: list[tuple[int, int]] = []
    remaining = 0

    def visit(body: list[ast.stmt], prefix: tuple[str, ...]) -> tuple[int, int]:
        nonlocal remaining
        tests = hidden_here = 0
        for node in body:
            key = (rel, *prefix, getattr(node, "name", ""))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
                "test"
            ):
                tests += 1
                if key in hidden:
                    hidden_here += 1
                    spans.append(
                        (
                            min([node.lineno] + [d.lineno for d in node.decorator_list]),
                            node.end_lineno,
                        )
                    )
                else:
                    remaining += 1
            elif isinstance(node, ast.ClassDef):
                before = len(spans)
                t, h = visit(node.body, (*prefix, node.name))
                if t and t == h:
                    del spans[before:]
                    spans.append(
                        (
                            min([node.lineno] + [d.lineno for d in node.decorator_list]),
                            node.end_lineno,
                        )
                    )
                tests += t
                hidden_here += h
        return tests, hidden_here

    visit(tree.body, ())
    if not remaining:
        return None
    return delete_spans(text, spans)


def hidden_keys(nodeids: Iterable[str]) -> set[tuple[str, ...]]:
    return {test_key(t) for t in nodeids}
