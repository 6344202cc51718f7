"""Project sources: `pypi:NAME[==VERSION]` sdists (downloaded with pip, cached) or local dirs.

Also the project's layout as tasks see it: which files are library code, which are tests,
which are test configuration, and the whitelist a workspace is rebuilt from.
"""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from cadenza.tasks.errors import TaskError

# Directories never copied into a workspace: VCS, caches, build output, envs, docs.
EXCLUDED_DIRS = {
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".tox",
    ".nox",
    ".venv",
    "venv",
    ".idea",
    ".vscode",
    "build",
    "dist",
    "htmlcov",
    "docs",
    "doc",
    ".eggs",
    ".cache",
    ".pyre",
    ".pytype",
    ".benchmarks",
}
ROOT_CONFIG = {
    "pyproject.toml",
    "setup.cfg",
    "setup.py",
    "tox.ini",
    "pytest.ini",
    "LICENSE",
    "LICENSE.txt",
    "LICENSE.md",
    "COPYING",
}
# Test configuration a prediction may never change (restored pristine for grading).
TEST_CONFIG = {"pyproject.toml", "setup.cfg", "setup.py", "tox.ini", "pytest.ini"}
DATA_SUFFIXES = {".txt", ".json", ".csv", ".tsv", ".cfg", ".ini", ".toml", ".yaml", ".yml"}
TEST_DIRS = {"tests", "test", "testing"}
BUILD_SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".pyx", ".pxd", ".f90", ".rs"}
# Files that Python runs on its own if they sit on sys.path: never allowed from a prediction.
STARTUP_FILES = {"sitecustomize.py", "usercustomize.py"}


@dataclass
class Project:
    """An unpacked project: where it is and what it is called."""

    root: Path
    name: str
    version: str
    source: str  # as given: "pypi:toolz==1.2.0" or a path
    sha256: str = ""  # of the sdist, when there is one
    tmp: Path | None = field(default=None, repr=False)  # delete when done

    def cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def default_cache_dir() -> Path:
    """<repo>/.cache when running from a checkout, else ~/.cache/cadenza."""
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").exists():
        return repo / ".cache"
    return Path.home() / ".cache" / "cadenza"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _safe_extract(archive: Path, dest: Path) -> None:
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for n in z.namelist():
                if n.startswith("/") or ".." in PurePosixPath(n).parts:
                    raise TaskError(f"{archive.name}: unsafe member path {n!r}; refusing to unpack")
            z.extractall(dest)
        return
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")


def download_sdist(name: str, version: str | None, cache_dir: Path, timeout: float = 300) -> Path:
    """The sdist of NAME[==VERSION] from the cache, or downloaded into it with pip."""
    sdists = cache_dir / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    norm = re.sub(r"[-_.]+", "_", name).lower()

    def cached() -> list[Path]:
        out = []
        for p in sdists.iterdir():
            m = re.match(r"(.+?)-(\d[^-]*?)\.(tar\.gz|zip|tar\.bz2)$", p.name)
            if m and re.sub(r"[-_.]+", "_", m.group(1)).lower() == norm:
                if version is None or m.group(2) == version:
                    out.append(p)
        return sorted(out)

    found = cached()
    if found:
        return found[-1]
    spec = f"{name}=={version}" if version else name
    with tempfile.TemporaryDirectory(dir=sdists) as tmp:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                tmp,
                spec,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        files = list(Path(tmp).iterdir())
        if r.returncode != 0 or not files:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise TaskError(
                f"pypi:{spec}: no source distribution could be downloaded "
                f"(pip said: {' | '.join(tail) or 'nothing'}); check the name and version, "
                "or pass a local project directory instead"
            )
        for f in files:
            f.rename(sdists / f.name)
    found = cached()
    if not found:
        raise TaskError(f"pypi:{spec}: pip downloaded {files[0].name}, which is not an sdist")
    return found[-1]


def _read_version(root: Path) -> str:
    pkg_info = root / "PKG-INFO"
    if pkg_info.exists():
        m = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    return "0+local"


def resolve(source: str, cache_dir: Path | None = None) -> Project:
    """Unpack SOURCE (`pypi:NAME[==VERSION]` or a directory) into a fresh temp dir."""
    cache_dir = cache_dir or default_cache_dir()
    tmp = Path(tempfile.mkdtemp(prefix="cadenza-src-"))
    try:
        if source.startswith("pypi:"):
            spec = source[len("pypi:") :]
            name, _, version = spec.partition("==")
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name or ""):
                raise TaskError(
                    f"{source!r}: expected pypi:NAME or pypi:NAME==VERSION, found name {name!r}"
                )
            sdist = download_sdist(name, version or None, cache_dir)
            _safe_extract(sdist, tmp)
            roots = [p for p in tmp.iterdir() if p.is_dir()]
            if len(roots) != 1:
                raise TaskError(
                    f"{sdist.name}: expected one top-level directory, found {len(roots)}"
                )
            root = roots[0]
            return Project(
                root, name.lower(), version or _read_version(root), source, _sha256(sdist), tmp
            )
        path = Path(source)
        if not path.is_dir():
            raise TaskError(
                f"{source!r}: expected a project directory or pypi:NAME[==VERSION]; "
                "no such directory"
            )
        root = tmp / path.resolve().name
        shutil.copytree(path, root, symlinks=True)
        return Project(root, path.resolve().name.lower(), _read_version(root), source, "", tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_test_path(rel: str) -> bool:
    """Test code and test support: test files, files in test dirs, conftest.py."""
    p = PurePosixPath(rel)
    if p.name == "conftest.py" or p.name.startswith("test_") or p.stem.endswith("_test"):
        return True
    return any(part in TEST_DIRS for part in p.parts[:-1])


def is_test_file(rel: str) -> bool:
    """A file pytest collects tests from (by its default naming rule)."""
    p = PurePosixPath(rel)
    return p.suffix == ".py" and (p.name.startswith("test_") or p.stem.endswith("_test"))


def is_protected(rel: str) -> bool:
    """Paths a prediction may not change: tests, test config, startup hooks."""
    p = PurePosixPath(rel)
    return (
        is_test_path(rel)
        or (len(p.parts) == 1 and p.name in TEST_CONFIG)
        or p.name in STARTUP_FILES
        or p.suffix == ".pth"
    )


def whitelist(root: Path) -> list[str]:
    """Relative paths (posix) of the files a workspace is rebuilt from, sorted."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        parts = rel.parts
        if any(p in EXCLUDED_DIRS or p.endswith(".egg-info") or p.startswith(".") for p in parts):
            continue
        if path.is_symlink() or not path.is_file():
            continue
        posix = rel.as_posix()
        if path.suffix == ".py" and path.name not in STARTUP_FILES:
            out.append(posix)
        elif len(parts) == 1 and path.name in ROOT_CONFIG:
            out.append(posix)
        elif path.suffix in DATA_SUFFIXES and is_test_path(posix):
            out.append(posix)
    return out


def import_root(root: Path) -> str:
    """Where the project's packages live relative to root: "src" (src layout) or "."."""
    return "src" if (root / "src").is_dir() and not (root / "src" / "__init__.py").exists() else "."


def library_files(root: Path, files: list[str]) -> list[str]:
    """Non-test Python modules importable from the import root (what features come from)."""
    base = import_root(root)
    out = []
    for rel in files:
        p = PurePosixPath(rel)
        if p.suffix != ".py" or is_test_path(rel) or p.name in {"setup.py", "conftest.py"}:
            continue
        inside = p.parts if base == "." else p.parts[1:] if p.parts[0] == base else None
        if not inside:
            continue
        # a root-level module or a file inside a package chain of __init__.py files
        ok = True
        for i in range(1, len(inside)):
            if not (root / base / PurePosixPath(*inside[:i]) / "__init__.py").exists():
                ok = False
                break
        if ok:
            out.append(rel)
    return out


def top_level_names(root: Path, files: list[str]) -> list[str]:
    """Top-level importable names of the project (packages and root modules)."""
    base = import_root(root)
    names = set()
    for rel in library_files(root, files):
        parts = PurePosixPath(rel).parts
        inside = parts if base == "." else parts[1:]
        names.add(inside[0][:-3] if len(inside) == 1 else inside[0])
    return sorted(names)


def check_buildable(root: Path, files: list[str]) -> None:
    """Reject projects that need build steps or cannot be parsed, with the reason."""
    ext = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix in BUILD_SUFFIXES
        and not any(x in EXCLUDED_DIRS for x in p.relative_to(root).parts)
    ]
    setup = root / "setup.py"
    if setup.exists() and re.search(
        r"\bExtension\s*\(|ext_modules\s*=", setup.read_text(errors="replace")
    ):
        ext.append("setup.py (ext_modules)")
    if ext:
        raise TaskError(
            f"project needs build steps (compiled extensions: {', '.join(ext[:5])}); "
            "cadenza builds tasks from pure-Python projects only: choose another project"
        )
    bad = []
    for rel in files:
        if rel.endswith(".py"):
            try:
                ast.parse((root / rel).read_bytes(), filename=rel)
            except (SyntaxError, ValueError) as e:
                bad.append(f"{rel}:{getattr(e, 'lineno', '?')}: {getattr(e, 'msg', e)}")
    if bad:
        raise TaskError(
            f"{len(bad)} Python file(s) do not parse with Python "
            f"{sys.version_info.major}.{sys.version_info.minor}, e.g. {bad[0]}; "
            "fix them or pick a project version that supports this Python"
        )
    if not library_files(root, files):
        raise TaskError("found no importable Python modules (expected a package or module)")
    if not any(is_test_file(f) for f in files):
        raise TaskError(
            "project has no tests (expected files named test_*.py or *_test.py); "
            "tasks need a test suite to verify them: choose a project whose sdist ships tests"
        )
