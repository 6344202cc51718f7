"""Removal, patch filtering, scoring and leak detection on small synthetic inputs (no network).

Oracles are hand-written expected texts and Python itself (ast, py_compile, git)."""

from __future__ import annotations

import ast
import py_compile
import subprocess
import sys
import time

import pytest

from cadenza.tasks import discover, leaks, remove
from cadenza.tasks.grade import filter_patch, score
from cadenza.tasks.runner import SubprocessRunner
from cadenza.tasks.scrub import init_repo
from cadenza.tasks.source import is_protected, whitelist

MODULE = '''"""Shapes."""
import math

__all__ = ["area", "perimeter", "unit"]


def _square(x):
    return x * x


def _norm(x):
    return abs(x)


# area of a circle
@staticmethod
def area(r):
    """Area of a circle of radius r."""
    return math.pi * _square(_norm(r))


def perimeter(r):
    return 2 * math.pi * _norm(r)


unit = area
area.__doc__ += " (also unit)"
'''

EXPECTED = '''"""Shapes."""
import math

__all__ = ['perimeter']


def _norm(x):
    return abs(x)


def perimeter(r):
    return 2 * math.pi * _norm(r)
'''


def _feature(name="area"):
    defs = discover.definitions("shapes.py", MODULE)
    d = next(x for x in defs if x.name == name)
    return [d, *discover.exclusive_helpers(d, defs, {"shapes.py": MODULE})]


def test_exclusive_helpers_are_only_those_nothing_else_uses():
    assert [d.name for d in _feature()] == ["area", "_square"]  # _norm is shared
    d = _feature()[0]
    assert d.start == 16 and d.end == 19  # decorator included
    assert d.body_lines == {19}  # docstring is not executed code


def test_removal_deletes_definitions_reexports_and_aliases_exactly():
    defs = _feature()
    text = remove.remove_definitions(MODULE, defs)
    text, aliases = remove.drop_references(text, {d.name for d in defs})
    assert aliases == {"unit"}
    assert text == EXPECTED
    ast.parse(text)


def test_from_imports_lose_only_the_removed_names():
    src = "from shapes import area, perimeter\nfrom shapes import area as a\nx = 1\n"
    text, removed = remove.drop_references(src, {"area"}, aliases=False)
    assert text == "from shapes import perimeter\nx = 1\n"
    assert removed == {"area", "a"}


def test_statement_sharing_a_line_is_refused():
    src = "def f():\n    return 1\nx = 1; y = f\n"
    with pytest.raises(remove.RemovalError):
        remove.drop_references(src, {"f"})


TESTS = """import unittest


def test_a():
    pass


class TestB(unittest.TestCase):
    def test_b1(self):
        pass

    def test_b2(self):
        pass


class TestC:
    def test_c(self):
        pass
"""


def test_remove_tests_functions_classes_and_files():
    hidden = remove.hidden_keys(
        ["t.py::test_a", "t.py::TestB::test_b1", "t.py::TestC::test_c[x-1]"]
    )
    text = remove.remove_tests("t.py", TESTS, hidden)
    assert text == (
        "import unittest\n\n\nclass TestB(unittest.TestCase):\n"
        "    def test_b2(self):\n        pass\n"
    )
    everything = hidden | remove.hidden_keys(["t.py::TestB::test_b2"])
    assert remove.remove_tests("t.py", TESTS, everything) is None


def test_tests_naming_finds_uses_and_module_level_dependence():
    texts = {
        "test_x.py": "from shapes import area\nR = area(1)\n\ndef test_p():\n    pass\n",
        "test_y.py": "import shapes\n\nclass T:\n    def test_q(self):\n        shapes.area(2)\n"
        "    def test_r(self):\n        pass\n",
    }
    keys, whole = discover.tests_naming(texts, list(texts), {"area"})
    assert keys == {("test_y.py", "T", "test_q")}
    assert whole == {"test_x.py"}


def test_protected_paths_and_patch_filtering():
    assert is_protected("tests/test_a.py") and is_protected("pkg/conftest.py")
    assert is_protected("pyproject.toml") and is_protected("sitecustomize.py")
    assert not is_protected("pkg/core.py") and not is_protected("pkg/pyproject.toml")
    patch = (
        "diff --git a/pkg/core.py b/pkg/core.py\n--- a/pkg/core.py\n+++ b/pkg/core.py\n"
        "@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/tests/test_core.py b/tests/test_core.py\n--- a/tests/test_core.py\n"
        "+++ b/tests/test_core.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/pkg/conftest.py b/pkg/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/pkg/conftest.py\n@@ -0,0 +1 @@\n+import pytest\n"
    )
    kept, dropped = filter_patch(patch)
    assert "pkg/core.py" in kept and "test_core" not in kept and "conftest" not in kept
    assert dropped == ["tests/test_core.py", "pkg/conftest.py"]


def test_score_counts_only_passed_tests():
    outcomes = {"a": "passed", "b": "skipped", "c": "xfailed", "d": "error", "p": "passed"}
    for f2p in (["a", "b"], ["a", "c"], ["a", "d"], ["a", "missing"]):
        assert not score(outcomes, f2p, ["p"])["resolved"]
    s = score(outcomes, ["a"], ["p"])
    assert s["resolved"] and s["pass_fraction"] == 1.0
    assert score(outcomes, ["a", "b"], ["p"])["pass_fraction"] == pytest.approx(2 / 3)


def _secret():
    return leaks.secret_for(_feature(), MODULE, "shapes")


def test_leak_scan_finds_each_planted_artifact(tmp_path):
    src = tmp_path / "shapes.py"
    src.write_text(MODULE)
    pyc = tmp_path / "__pycache__" / "shapes.cpython-311.pyc"
    py_compile.compile(str(src), cfile=str(pyc), dfile="shapes.py", doraise=True)
    src.write_text(EXPECTED)  # the workspace's source no longer has it
    mypy = tmp_path / ".mypy_cache" / "3.11" / "shapes.data.json"
    mypy.parent.mkdir(parents=True)
    mypy.write_text('{"names": {"area": {"fullname": "shapes.area", "type": "def (r: Any)"}}}')
    egg = tmp_path / "shapes.egg-info" / "SOURCES.txt"
    egg.parent.mkdir()
    egg.write_text("shapes.py\ntests/test_area.py\n")
    secret = _secret()
    secret.removed_files = {"tests/test_area.py"}
    found = leaks.scan_tree(tmp_path, secret)
    assert any(f.startswith("__pycache__/") and "compiled" in f for f in found), found
    assert any(f.startswith(".mypy_cache/") for f in found), found
    assert any(f.startswith("shapes.egg-info/") for f in found), found
    assert not any(f.startswith("shapes.py") for f in found)


def test_git_history_is_scrubbed_by_construction_and_scanned(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "shapes.py").write_text(MODULE)
    init_repo(proj)  # history containing the code
    (proj / "shapes.py").write_text(EXPECTED)
    subprocess.run(
        ["git", "commit", "-qam", "remove"],
        cwd=proj,
        check=True,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "GIT_AUTHOR_NAME": "x",
            "GIT_AUTHOR_EMAIL": "x@x",
            "GIT_COMMITTER_NAME": "x",
            "GIT_COMMITTER_EMAIL": "x@x",
        },
    )
    assert any(f.startswith(".git/objects/") for f in leaks.scan_tree(proj, _secret()))
    ws = tmp_path / "ws"
    ws.mkdir()
    for rel in whitelist(proj):
        (ws / rel).write_text((proj / rel).read_text())
    init_repo(ws)
    log = subprocess.run(
        ["git", "log", "--all", "--oneline", "-S", "_square"],
        cwd=ws,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert log == ""
    assert leaks.scan_tree(ws, _secret()) == []


def test_installed_copy_in_environment_is_found(tmp_path):
    from cadenza.tasks.build import check_not_installed
    from cadenza.tasks.errors import TaskError

    venv = tmp_path / "venv"
    subprocess.run(
        [
            getattr(sys, "_base_executable", sys.executable),
            "-m",
            "venv",
            "--without-pip",
            str(venv),
        ],
        check=True,
    )
    site = next(venv.glob("lib/python*/site-packages"))
    check_not_installed(venv, ["shapes"])
    (site / "shapes.py").write_text(MODULE)
    with pytest.raises(TaskError, match="installed copy of shapes"):
        check_not_installed(venv, ["shapes"])
    assert any("installed copy" in f for f in leaks.scan_tree(site, _secret(), env=True))
    # another package defining a function of the same name is not a copy; a copy under
    # another file name is
    (site / "shapes.py").unlink()
    (site / "other.py").write_text("def area(x):\n    return x\n\n\ndef _square(y):\n    pass\n")
    assert leaks.scan_tree(site, _secret(), env=True) == []
    (site / "vendored.py").write_text(MODULE.replace("def area", "def vendored_area"))
    assert [f for f in leaks.scan_tree(site, _secret(), env=True) if f.startswith("vendored.py")]


def test_runner_timeout_kills_the_process_tree(tmp_path):
    marker = tmp_path / "survived"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    r = SubprocessRunner().run([sys.executable, str(script)], tmp_path, timeout=1.0)
    assert r.timed_out and time.monotonic() - t0 < 10
    time.sleep(3.5)
    assert not marker.exists()


def test_runner_caps_output(tmp_path):
    r = SubprocessRunner(output_limit=1000).run(
        [sys.executable, "-c", "print('x' * 100000)"], tmp_path, timeout=30
    )
    assert r.returncode == 0 and len(r.stdout) < 1200 and "cut" in r.stdout


def test_fingerprints_need_the_body_in_order_not_similar_code():
    secret = _secret()
    copy = (
        "def area_again(r):\n    # reformatted copy\n        return math.pi * _square(_norm(r))\n"
    )
    similar = "def other(r):\n    return math.pi * _norm(r)\n"
    whole = MODULE.replace("def area(r)", "def area2(r)").replace("_square", "_sq")
    assert leaks.longest_common_run(["a", "b", "c", "d"], ["x", "b", "c", "y"]) == 2
    assert leaks.scan_text(similar, "x.py", secret) is None
    assert leaks.scan_text(whole, "x.py", secret) is None or "area" in leaks.scan_text(
        whole, "x.py", secret
    )
    assert leaks.scan_text(copy, "notes.txt", secret) is not None  # private helper name


def test_tasks_layer_does_not_import_torch():
    code = "import sys, cadenza.tasks, cadenza.cli.tasks, cadenza.bench.tasks; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_difficulty_bands_partition_scores_and_bad_band_is_refused(tmp_path):
    from cadenza.tasks.build import BANDS, BuildOptions, build, difficulty_score
    from cadenza.tasks.errors import TaskError

    small = {"lines_removed": 10, "symbols_removed": 1, "files_removed": 0, "centrality": 0.0}
    big = {"lines_removed": 80, "symbols_removed": 3, "files_removed": 0, "centrality": 0.05}
    assert difficulty_score(small) == 0.5 and difficulty_score(big) == 6.5
    bands = [b for b in ("easy", "medium", "hard") if BANDS[b][0] <= 0.5 < BANDS[b][1]]
    assert bands == ["easy"]
    with pytest.raises(TaskError, match="expected one of easy, medium, hard, any"):
        build(
            str(tmp_path), tmp_path / "out", BuildOptions(difficulty="brutal"), log=lambda m: None
        )
    assert not (tmp_path / "out").exists()


def test_whole_module_removal_drops_its_imports_and_aliases():
    from cadenza.tasks.discover import find_module_features
    from cadenza.tasks.gates import plan_removal

    texts = {
        "pkg/__init__.py": "from .shapes import *\nfrom .util import twice\n",
        "pkg/shapes.py": MODULE,
        "pkg/util.py": "from pkg import shapes\nfrom pkg.shapes import area as a\n\n\n"
        "def twice(x):\n    return 2 * x\n\n\nhalf_unit = shapes.unit\n",
    }
    cov = {"pkg/shapes.py": {19: ["test_t.py::test_area"]}}
    lib = list(texts)
    feats = find_module_features(texts, lib, cov, {"test_t.py::test_area"})
    assert [(f.module, f.kind, f.files_removed) for f in feats] == [("pkg.shapes", "module", 1)]
    changed, names, _ = plan_removal(texts, lib, feats[0])
    assert changed["pkg/shapes.py"] is None
    assert changed["pkg/__init__.py"] == "from .util import twice\n"
    assert changed["pkg/util.py"] == "def twice(x):\n    return 2 * x\n"
    assert {"area", "perimeter", "shapes", "a", "half_unit"} <= names
