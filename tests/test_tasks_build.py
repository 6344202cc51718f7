"""End-to-end task building on a small synthetic project written here (no network):
valid tasks, grading (gold resolves; empty, test-deleting and skipping patches do not),
export, scrub of planted artifacts, and clear errors for bad input with nothing left behind.
"""

from __future__ import annotations

import ast
import json
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from cadenza.tasks.build import BuildOptions, build
from cadenza.tasks.errors import TaskError
from cadenza.tasks.grade import grade_prediction
from cadenza.tasks.scrub import init_repo
from cadenza.tasks.store import export, read_tasks

CORE = '''"""Arithmetic."""

__all__ = ["add", "clamp", "scale"]


def _check_pair(a, b):
    for x in (a, b):
        if not isinstance(x, (int, float)):
            raise TypeError(f"expected a number, got {x!r}")


def add(a, b):
    """Sum of two numbers; TypeError for anything else."""
    _check_pair(a, b)
    return a + b


def clamp(x, lo, hi):
    """x limited to [lo, hi]."""
    if lo > hi:
        raise ValueError("lo > hi")
    return max(lo, min(x, hi))


def scale(xs, k):
    return [x * k for x in xs]
'''

STATS = """from calc.core import add


def mean(xs):
    total = 0
    for x in xs:
        total = add(total, x)
    return total / len(xs)
"""

TEST_CORE = """import pytest

from calc import add, clamp, scale


@pytest.mark.parametrize("a,b,s", [(1, 2, 3), (0.5, 0.5, 1.0)])
def test_add(a, b, s):
    assert add(a, b) == s


def test_add_rejects_strings():
    with pytest.raises(TypeError):
        add("1", 2)


def test_clamp():
    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0


def test_clamp_bad_range():
    with pytest.raises(ValueError):
        clamp(1, 2, 0)


def test_scale():
    assert scale([1, 2], 3) == [3, 6]
"""

TEST_STATS = """from calc.stats import mean


def test_mean():
    assert mean([1, 2, 3]) == 2
"""


def make_project(root: Path, **extra: str) -> Path:
    """The synthetic project `calc` (every variant has that name: one cached environment)."""
    proj = root / "calc"
    files = {
        "calc/__init__.py": "from calc.core import add, clamp, scale\n",
        "calc/core.py": CORE,
        "calc/stats.py": STATS,
        "tests/test_core.py": TEST_CORE,
        "tests/test_stats.py": TEST_STATS,
        "pyproject.toml": '[project]\nname = "calc"\nversion = "0.1"\n',
        **extra,
    }
    for rel, text in files.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text)
    return proj


def plant_artifacts(proj: Path) -> None:
    """Everything a sloppy generator would leave behind, all containing the original code."""
    py_compile.compile(
        str(proj / "calc/core.py"),
        cfile=str(proj / "calc/__pycache__/core.cpython-311.pyc"),
        dfile="calc/core.py",
        doraise=True,
    )
    (proj / ".mypy_cache/3.11/calc").mkdir(parents=True)
    (proj / ".mypy_cache/3.11/calc/core.data.json").write_text(
        '{"fullname": "calc.core.add", "type": "def (a: Any, b: Any) -> Any"}'
    )
    (proj / "calc.egg-info").mkdir()
    (proj / "calc.egg-info/SOURCES.txt").write_text("calc/core.py\ntests/test_core.py\n")
    (proj / ".pytest_cache").mkdir()
    (proj / ".pytest_cache/README.md").write_text("x")
    init_repo(proj)  # git history with the code


def _no_leftovers(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("calc")
    proj = make_project(root)
    plant_artifacts(proj)
    out = root / "tasks"
    summary = build(str(proj), out, BuildOptions(max_tasks=2, timeout=120), log=lambda m: None)
    return out, summary


@pytest.mark.slow
def test_build_yields_valid_tasks(built):
    out, summary = built
    tasks = read_tasks(out)
    assert summary["accepted"] == len(tasks) == 2
    # one columnar table: same keys and types on every line
    shapes = [{k: type(v).__name__ for k, v in t.items()} for t in tasks]
    assert all(s == shapes[0] for s in shapes)
    for key in (
        "instance_id",
        "repo",
        "base_commit",
        "patch",
        "test_patch",
        "problem_statement",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "version",
    ):
        assert key in shapes[0]
    add = next(t for t in tasks if t["feature"]["name"] == "add")
    assert "_check_pair" in add["feature"]["removed_names"]
    assert "tests/test_stats.py::test_mean" in add["FAIL_TO_PASS"]  # uses it via stats.mean
    assert "tests/test_core.py::test_scale" in add["PASS_TO_PASS"]
    assert (
        "def add(a, b)" in add["problem_statement"]
        and "return a + b" not in add["problem_statement"]
    )


@pytest.mark.slow
def test_exported_workspace_is_scrubbed_and_lacks_the_feature(built, tmp_path):
    out, _ = built
    for task in read_tasks(out):
        ws = tmp_path / task["instance_id"]
        assert export(out, task["instance_id"], ws) == task["base_commit"]
        count = subprocess.run(
            ["git", "rev-list", "--all", "--count"],
            cwd=ws,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert count.strip() == "1"
        files = sorted(
            p.relative_to(ws).as_posix()
            for p in ws.rglob("*")
            if p.is_file() and ".git" not in p.parts
        )
        assert not [
            f
            for f in files
            if "__pycache__" in f or "mypy" in f or "egg-info" in f or "pytest_cache" in f
        ], files
        defined = {
            n.name
            for f in files
            if f.endswith(".py")
            for n in ast.parse((ws / f).read_text()).body
            if isinstance(n, ast.FunctionDef)
        }
        assert not defined & set(task["feature"]["removed_names"])
        tests_left = {
            n.name
            for f in files
            if f.startswith("tests/")
            for n in ast.walk(ast.parse((ws / f).read_text()))
            if isinstance(n, ast.FunctionDef)
        }
        hidden = {t.split("::")[-1].split("[")[0] for t in task["FAIL_TO_PASS"]}
        assert not hidden & tests_left


def _patch_in(ws: Path, edit) -> str:
    edit(ws)
    subprocess.run(["git", "add", "-A"], cwd=ws, check=True)
    return subprocess.run(
        ["git", "diff", "--cached"], cwd=ws, capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.slow
def test_grading_gold_resolves_and_cheats_do_not(built, tmp_path):
    out, _ = built
    task = next(t for t in read_tasks(out) if t["feature"]["name"] == "add")
    tar = out / "workspaces" / f"{task['instance_id']}.tar"

    def grade(patch):
        return grade_prediction(task, tar, patch, timeout=120)

    assert grade(task["patch"])["resolved"]
    assert not grade("")["resolved"]

    ws = tmp_path / "ws"
    export(out, task["instance_id"], ws)

    # a patch that plants trivial versions of the hidden tests, empties the visible ones and
    # skips everything from a new conftest.py
    def cheat_edit(w: Path) -> None:
        (w / "tests/test_stats.py").write_text("def test_mean():\n    pass\n")
        (w / "tests/test_core.py").write_text("")
        (w / "conftest.py").write_text(
            "import pytest\n\ndef pytest_collection_modifyitems(items):\n"
            "    for i in items:\n        i.add_marker(pytest.mark.skip)\n"
        )

    r = grade(_patch_in(ws, cheat_edit))
    assert not r["resolved"] and r["fail_to_pass_passed"] == 0
    assert set(r["dropped_paths"]) == {"tests/test_stats.py", "tests/test_core.py", "conftest.py"}
    subprocess.run(["git", "reset", "-q", "--hard"], cwd=ws, check=True)
    # library code that skips instead of working: skipped counts as failure
    skip = _patch_in(
        ws,
        lambda w: (w / "calc/core.py").write_text(
            (w / "calc/core.py").read_text()
            + "\n\ndef add(a, b):\n    import pytest\n    pytest.skip('later')\n"
        ),
    )
    r = grade(skip)
    assert not r["resolved"] and r["fail_to_pass_passed"] == 0


@pytest.mark.slow
def test_grade_cli_writes_report(built, tmp_path):
    out, _ = built
    task = read_tasks(out)[0]
    preds = tmp_path / "preds.jsonl"
    preds.write_text(
        json.dumps(
            {
                "instance_id": task["instance_id"],
                "model_patch": task["patch"],
                "model_name_or_path": "gold",
            }
        )
        + "\n"
    )
    report = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadenza.cli.main",
            "tasks",
            "grade",
            str(out),
            "--predictions",
            str(preds),
            "--out",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(report.read_text())[task["instance_id"]]["resolved"] is True


def test_no_tests_is_refused_cleanly(tmp_path):
    proj = make_project(tmp_path)
    for f in (proj / "tests").iterdir():
        f.unlink()
    out = tmp_path / "out"
    with pytest.raises(TaskError, match="has no tests"):
        build(str(proj), out, log=lambda m: None)
    _no_leftovers(out)


def test_unparsable_file_is_refused_cleanly(tmp_path):
    proj = make_project(tmp_path, **{"calc/broken.py": "def f(:\n    pass\n"})
    out = tmp_path / "out"
    with pytest.raises(TaskError, match=r"do not parse.*calc/broken.py:1"):
        build(str(proj), out, log=lambda m: None)
    _no_leftovers(out)


def test_missing_directory_and_nonempty_out_are_refused(tmp_path):
    with pytest.raises(TaskError, match="no such directory"):
        build(str(tmp_path / "nope"), tmp_path / "out", log=lambda m: None)
    _no_leftovers(tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(TaskError, match="not empty"):
        build(str(make_project(tmp_path)), tmp_path / "full", log=lambda m: None)
    assert (tmp_path / "full" / "x").read_text() == "keep me"


@pytest.mark.slow
def test_failing_suite_is_refused_cleanly(tmp_path):
    proj = make_project(tmp_path, **{"tests/test_bad.py": "def test_bad():\n    assert 1 == 2\n"})
    out = tmp_path / "out"
    with pytest.raises(TaskError, match=r"suite fails: 1 of .*test_bad.py::test_bad"):
        build(str(proj), out, log=lambda m: None)
    _no_leftovers(out)


@pytest.mark.slow
def test_hanging_test_times_out_cleanly(tmp_path):
    proj = make_project(
        tmp_path, **{"tests/test_hang.py": "import time\n\ndef test_hang():\n    time.sleep(600)\n"}
    )
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadenza.cli.main",
            "tasks",
            "build",
            str(proj),
            "--out",
            str(out),
            "--timeout",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert "did not finish within 12s" in r.stderr
    _no_leftovers(out)


@pytest.mark.network
@pytest.mark.slow
def test_missing_sdist_is_refused_cleanly(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(TaskError, match="no source distribution could be downloaded"):
        build("pypi:cadenza-no-such-project-xq7==0.0.1", out, log=lambda m: None)
    _no_leftovers(out)


@pytest.mark.slow
def test_grading_runs_predictions_in_the_sandbox(built, tmp_path):
    from cadenza.sandbox import isolation

    if not isolation().available:
        pytest.skip("no bubblewrap isolation on this machine")
    out, _ = built
    task = next(t for t in read_tasks(out) if t["feature"]["name"] == "add")
    host_file = tmp_path / "escaped.txt"
    ws = tmp_path / "ws"
    export(out, task["instance_id"], ws)
    # the gold code plus a write to a host path outside the workspace, at import time
    assert (
        subprocess.run(["git", "apply", "-"], cwd=ws, input=task["patch"], text=True).returncode
        == 0
    )
    patch = _patch_in(
        ws,
        lambda w: (w / "calc/core.py").write_text(
            (w / "calc/core.py").read_text()
            + f"\ntry:\n    open({str(host_file)!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
        ),
    )
    r = grade_prediction(
        task, out / "workspaces" / f"{task['instance_id']}.tar", patch, timeout=120
    )
    assert r["resolved"]  # the code works...
    assert not host_file.exists()  # ...but could not touch the host
    from cadenza.tasks.runner import SubprocessRunner

    grade_prediction(
        task,
        out / "workspaces" / f"{task['instance_id']}.tar",
        patch,
        timeout=120,
        runner=SubprocessRunner(),
    )
    assert host_file.exists()  # the same prediction unsandboxed does (the oracle)
