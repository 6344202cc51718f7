import json
import os
import sys

import pytest

from agent_support import local_run, make_workspace
from cadenza.agent.json_schema import validate
from cadenza.agent.tools import (
    INVALID_ARGUMENTS,
    PATH_OUTSIDE_WORKSPACE,
    TOOL_FAILED,
    UNKNOWN_TOOL,
    Toolbox,
    ToolContext,
)


@pytest.fixture
def ctx(tmp_path):
    ws = tmp_path / "ws"
    make_workspace(ws)
    return ToolContext(
        workspace=ws,
        run_command=local_run,
        test_command=(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
    )


def test_schemas_are_openai_function_definitions():
    box = Toolbox()
    assert box.names == [
        "list_dir",
        "read_file",
        "write_file",
        "str_replace",
        "search",
        "run",
        "run_tests",
        "submit",
    ]
    for s in box.schemas():
        json.dumps(s)
        assert s["type"] == "function"
        f = s["function"]
        assert set(f) == {"name", "description", "parameters"}
        assert f["parameters"]["type"] == "object"
        assert f["parameters"]["additionalProperties"] is False
        assert set(f["parameters"]["required"]) <= set(f["parameters"]["properties"])


def test_validator_subset():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 1},
            "b": {"type": "string", "enum": ["x", "y"]},
            "c": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    assert validate({"a": 1, "b": "x", "c": [1, 2.5]}, schema) == []
    assert validate({"a": True}, schema) == ["arguments.a: expected integer, found boolean True"]
    assert validate({}, schema) == ["arguments: missing required property 'a'"]
    assert validate({"a": 0}, schema) == ["arguments.a: expected >= 1, found 0"]
    assert "expected one of ['x', 'y']" in validate({"a": 1, "b": "z"}, schema)[0]
    assert "unexpected properties ['d']" in validate({"a": 1, "d": 1}, schema)[0]
    assert validate({"a": 1, "c": [1, "2"]}, schema) == [
        "arguments.c[1]: expected number, found string '2'"
    ]
    assert validate([1], schema) == ["arguments: expected object, found array [1]"]


def test_unknown_tool_and_invalid_arguments(ctx):
    box = Toolbox()
    r = box.call("grep", {"pattern": "x"}, ctx)
    assert r.error_kind == UNKNOWN_TOOL
    assert r.observation == (
        "Tool not found: grep. Available tools: list_dir, read_file, write_file, "
        "str_replace, search, run, run_tests, submit"
    )
    r = box.call("read_file", {"path": 3}, ctx)
    assert r.error_kind == INVALID_ARGUMENTS
    assert "arguments.path: expected string, found integer 3" in r.observation
    r = box.call("read_file", {"path": "calc.py", "mode": "r"}, ctx)
    assert r.error_kind == INVALID_ARGUMENTS and "unexpected properties ['mode']" in r.observation
    r = box.call("write_file", None, ctx)
    assert r.error_kind == INVALID_ARGUMENTS


def test_file_tools(ctx):
    box = Toolbox()
    r = box.call("list_dir", {}, ctx)
    assert r.error_kind is None and r.observation.splitlines() == ["calc.py", "tests/"]
    r = box.call("read_file", {"path": "calc.py", "start_line": 2, "end_line": 2}, ctx)
    assert r.observation == "2\t    return a + b"
    r = box.call("read_file", {"path": "calc.py", "start_line": 99}, ctx)
    assert r.error_kind == TOOL_FAILED
    r = box.call("write_file", {"path": "pkg/new.py", "content": "X = 1\n"}, ctx)
    assert r.error_kind is None
    assert (ctx.workspace / "pkg" / "new.py").read_text() == "X = 1\n"
    r = box.call(
        "str_replace",
        {"path": "calc.py", "old_str": "raise NotImplementedError", "new_str": "return a * b"},
        ctx,
    )
    assert r.error_kind is None
    assert "return a * b" in (ctx.workspace / "calc.py").read_text()
    r = box.call("str_replace", {"path": "calc.py", "old_str": "return", "new_str": "x"}, ctx)
    assert r.error_kind == TOOL_FAILED and "occurs 2 times" in r.observation
    r = box.call("str_replace", {"path": "calc.py", "old_str": "nope", "new_str": "x"}, ctx)
    assert r.error_kind == TOOL_FAILED and "not found" in r.observation
    (ctx.workspace / "blob.bin").write_bytes(b"\x00\x01\xff" * 10)
    r = box.call("read_file", {"path": "blob.bin"}, ctx)
    assert r.observation == "blob.bin: binary file, 30 bytes"


def test_paths_are_confined(ctx, tmp_path):
    box = Toolbox()
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.symlink(secret, ctx.workspace / "link.txt")
    os.symlink(tmp_path, ctx.workspace / "up")
    for name, args in [
        ("read_file", {"path": "../secret.txt"}),
        ("read_file", {"path": str(secret)}),
        ("read_file", {"path": "link.txt"}),
        ("read_file", {"path": "up/secret.txt"}),
        ("write_file", {"path": "../evil.py", "content": "x"}),
        ("write_file", {"path": "up/evil.py", "content": "x"}),
        ("str_replace", {"path": "link.txt", "old_str": "s", "new_str": "t"}),
        ("list_dir", {"path": "/"}),
        ("search", {"pattern": "s3cret", "path": ".."}),
        ("run_tests", {"path": "../"}),
    ]:
        r = box.call(name, args, ctx)
        assert r.error_kind == PATH_OUTSIDE_WORKSPACE, (name, args, r)
        assert "s3cret" not in r.observation
    assert secret.read_text() == "s3cret"
    assert not (tmp_path / "evil.py").exists()


def test_sandboxed_tools(ctx):
    box = Toolbox()
    r = box.call("search", {"pattern": "def (add|mul)"}, ctx)
    assert r.error_kind is None
    assert sorted(r.observation.splitlines()) == [
        "calc.py:1:def add(a, b):",
        "calc.py:5:def mul(a, b):",
    ]
    assert box.call("search", {"pattern": "zzz_nothing"}, ctx).observation.startswith("no matches")
    r = box.call("run", {"command": "echo hi; echo err >&2; exit 3"}, ctx)
    assert r.observation == "exit code: 3\nstdout:\nhi\nstderr:\nerr"
    r = box.call("run_tests", {}, ctx)
    assert r.observation.startswith("exit code: 0") and "1 passed" in r.observation
    r = box.call("run", {"command": "python3 -c \"print('x' * 100000)\""}, ctx)
    assert len(r.observation) <= ctx.max_observation_chars + 100
    assert "characters omitted" in r.observation
    r = box.call("submit", {}, ctx)
    assert r.done and r.error_kind is None


def test_tools_through_the_real_sandbox(tmp_path):
    import cadenza.sandbox as sandbox
    from cadenza.agent.runner import workspace_patch

    isolated = bool(sandbox.isolation().bwrap)
    ws = tmp_path / "ws"
    make_workspace(ws)
    ctx = ToolContext(
        workspace=ws,
        test_command=(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
        ro_binds=(sys.prefix,),  # the interpreter's environment, read-only
        unsafe=not isolated,
    )
    box = Toolbox()
    assert box.call("search", {"pattern": "def mul"}, ctx).observation == "calc.py:5:def mul(a, b):"
    r = box.call("run_tests", {}, ctx)
    assert r.observation.startswith("exit code: 0") and "1 passed" in r.observation, r.observation
    box.call("write_file", {"path": "calc.py", "content": "X = 1\n"}, ctx)
    r = box.call("run", {"command": "echo made > new.txt; cat new.txt"}, ctx)
    assert r.observation == "exit code: 0\nstdout:\nmade"
    if isolated:
        r = box.call("run", {"command": "echo x > /tmp/../../outside.txt; ls /work/main 2>&1"}, ctx)
        assert not (tmp_path.parent / "outside.txt").exists()
    patch = workspace_patch(ctx)
    assert "+X = 1" in patch and "new.txt" in patch and "__pycache__" not in patch
