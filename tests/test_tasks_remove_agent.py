"""The agent-driven remover against a scripted OpenAI-compatible server written here.

The server replays tool calls (a correct deletion, one that deletes too much, one that leaves
the feature, malformed calls); the oracles are the gates and the grader themselves and the
ast strategy on the same feature (same FAIL_TO_PASS / PASS_TO_PASS sets).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cadenza.tasks.build import BuildOptions, build
from cadenza.tasks.discover import find_features
from cadenza.tasks.environment import ensure_venv, spec_for
from cadenza.tasks.errors import TaskError
from cadenza.tasks.gates import Job, validate
from cadenza.tasks.grade import grade_prediction
from cadenza.tasks.remove_agent import AgentRemoverOptions
from cadenza.tasks.runner import default_runner
from cadenza.tasks.scrub import copy_files
from cadenza.tasks.source import default_cache_dir, import_root, library_files, resolve, whitelist
from cadenza.tasks.store import read_tasks
from cadenza.tasks.testrun import run_tests
from test_tasks_build import CORE  # the same small project

ADD_BLOCK = CORE[CORE.index("def _check_pair") : CORE.index("def clamp")]

FILES = {
    "calc/__init__.py": "from calc.core import add, clamp, scale\n",
    "calc/core.py": CORE,
    "calc/stats.py": "from calc.core import add\n\n\ndef mean(xs):\n    total = 0\n"
    "    for x in xs:\n        total = add(total, x)\n    return total / len(xs)\n",
    "tests/test_core.py": "import pytest\n\nfrom calc import add, clamp, scale\n\n\n"
    "def test_add():\n    assert add(1, 2) == 3\n\n\n"
    "def test_add_rejects_strings():\n    with pytest.raises(TypeError):\n"
    '        add("1", 2)\n\n\n'
    "def test_clamp():\n    assert clamp(5, 0, 3) == 3\n\n\n"
    "def test_clamp_bad_range():\n    with pytest.raises(ValueError):\n"
    "        clamp(1, 2, 0)\n\n\n"
    "def test_scale():\n    assert scale([1, 2], 3) == [3, 6]\n",
    "tests/test_stats.py": "from calc.stats import mean\n\n\n"
    "def test_mean():\n    assert mean([1, 2, 3]) == 2\n",
    "pyproject.toml": '[project]\nname = "calc"\nversion = "0.1"\n',
}


def call(name: str, **args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def correct_removal() -> list[list[dict]]:
    """What a careful model does for `add`: definitions, helper, re-exports, imports."""
    return [
        [call("list_dir", path="calc"), call("read_file", path="calc/core.py")],
        [
            call("str_replace", path="calc/core.py", old_str=ADD_BLOCK, new_str=""),
            call(
                "str_replace",
                path="calc/core.py",
                old_str='__all__ = ["add", "clamp", "scale"]',
                new_str='__all__ = ["clamp", "scale"]',
            ),
            call(
                "write_file",
                path="calc/__init__.py",
                content="from calc.core import clamp, scale\n",
            ),
            call(
                "str_replace",
                path="calc/stats.py",
                old_str="from calc.core import add\n\n\n",
                new_str="",
            ),
        ],
        [call("run_tests")],
        [call("done")],
    ]


def too_much() -> list[list[dict]]:
    """The correct removal, plus clamp's range check (a PASS_TO_PASS test needs it)."""
    steps = correct_removal()
    steps[1].append(
        call(
            "str_replace",
            path="calc/core.py",
            old_str='    if lo > hi:\n        raise ValueError("lo > hi")\n',
            new_str="",
        )
    )
    return steps


def leaves_feature() -> list[list[dict]]:
    return [
        [
            call(
                "str_replace",
                path="calc/core.py",
                old_str="Sum of two numbers; TypeError for anything else.",
                new_str="Sum.",
            )
        ],
        [call("done")],
    ]


def malformed() -> list[list[dict]]:
    return [
        [
            {"type": "function", "function": {"name": "read_file", "arguments": "{not json"}},
            call("explode"),
            call("write_file", path="tests/test_core.py", content=""),
            call("read_file", path="../../etc/passwd"),
            call("read_file", path="calc/core.py", start_line="x"),
            call("str_replace", path="calc/core.py", old_str="return", new_str=""),
            {"type": "function"},
            {"type": "function", "function": {"name": "read_file", "arguments": "[1, 2]"}},
        ],
        "no tool call, just talk",
        [call("done")],
    ]


class Scripted:
    """An OpenAI-compatible /v1/chat/completions server replaying `scripts[feature]`."""

    def __init__(self, scripts: dict, garbage: bool = False, status: int = 200, delay: float = 0):
        self.scripts, self.garbage, self.status, self.requests = scripts, garbage, status, []
        self.delay = delay
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                time.sleep(outer.delay)
                data = b"<html>not json</html>" if outer.garbage else outer.answer(body)
                status = outer.status if self.path == "/v1/chat/completions" else 404
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> bytes:
        user = body["messages"][1]["content"]
        name = next((n for n in self.scripts if f"`{n}`" in user), None)
        steps = self.scripts[name]() if name else [[call("done")]]
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        step = steps[min(turn, len(steps) - 1)]
        if isinstance(step, str):
            msg = {"role": "assistant", "content": step}
        else:
            calls = [{"id": f"call{turn}_{i}", **c} for i, c in enumerate(step)]
            msg = {"role": "assistant", "content": None, "tool_calls": calls}
        return json.dumps(
            {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 20},
            }
        ).encode()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The calc project, its environment, the original run and the feature `add`."""
    root = tmp_path_factory.mktemp("calc")
    proj = root / "calc"
    for rel, text in FILES.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text)
    p = resolve(str(proj))
    files = whitelist(p.root)
    baseline = root / "baseline"
    copy_files(p.root, baseline, files)
    spec = spec_for(p.name, p.version, p.root)
    venv = ensure_venv(spec, default_cache_dir())
    first = run_tests(default_runner(), baseline, venv, timeout=120, coverage=True)
    passing = first.passed()
    assert len(passing) == 6
    texts = {r: (baseline / r).read_text() for r in files if r.endswith(".py")}
    library = library_files(baseline, files)
    feats = find_features(texts, library, first.coverage, passing, import_root(baseline))
    feature = next(f for f in feats if f.name == "add")

    def job(out: Path, agent: AgentRemoverOptions | None) -> Job:
        out.mkdir(parents=True, exist_ok=True)
        return Job(
            feature=feature,
            baseline=baseline,
            files=files,
            venv=venv,
            env_spec=spec,
            passing=sorted(passing),
            coverage={r: first.coverage.get(r, {}) for r in library},
            tar_path=out / "add.tar",
            project={"name": p.name, "version": p.version, "source": str(proj), "sdist_sha256": ""},
            timeout=120,
            agent=agent,
        )

    return proj, job, venv


@pytest.fixture
def server():
    made = []

    def start(scripts, garbage=False, status=200, delay=0):
        made.append(Scripted(scripts, garbage, status, delay))
        return made[-1]

    yield start
    for s in made:
        s.close()


@pytest.mark.slow
def test_agent_removal_passes_the_gates_like_the_ast_strategy(project, server, tmp_path):
    _, job, venv = project
    srv = server({"add": correct_removal})
    agent = validate(job(tmp_path / "agent", AgentRemoverOptions(srv.url, "scripted")))
    ast = validate(job(tmp_path / "ast", None))
    assert agent["ok"], agent.get("reason")
    assert ast["ok"], ast.get("reason")
    a, b = agent["instance"], ast["instance"]
    assert a["FAIL_TO_PASS"] == b["FAIL_TO_PASS"]
    assert a["PASS_TO_PASS"] == b["PASS_TO_PASS"]
    assert "tests/test_stats.py::test_mean" in a["FAIL_TO_PASS"]
    assert a["provenance"]["strategy"] == "agent" and a["provenance"]["turns"] == 4
    assert sorted(a["provenance"]["files_changed"]) == [
        "calc/__init__.py",
        "calc/core.py",
        "calc/stats.py",
    ]
    tar = tmp_path / "agent" / "add.tar"
    gold = grade_prediction(a, tar, a["patch"], venv=venv, timeout=120)
    assert gold["resolved"]
    empty = grade_prediction(a, tar, "", venv=venv, timeout=120)
    assert not empty["resolved"]
    # the model saw the tool set and the hidden tests it must make fail
    first = srv.requests[0]
    assert {t["function"]["name"] for t in first["tools"]} >= {"str_replace", "run_tests", "done"}
    assert "tests/test_stats.py::test_mean" in first["messages"][1]["content"]
    run_obs = [m for m in srv.requests[3]["messages"] if m["role"] == "tool"][-1]["content"]
    assert "3 of 3 visible tests pass" in run_obs


@pytest.mark.slow
def test_deleting_too_much_or_too_little_is_rejected_by_the_gates(project, server, tmp_path):
    _, job, _ = project
    srv = server({"add": too_much})
    r = validate(job(tmp_path / "a", AgentRemoverOptions(srv.url, "scripted")))
    assert not r["ok"] and "PASS_TO_PASS" in r["reason"] and "clamp_bad_range" in r["reason"]
    srv = server({"add": leaves_feature})
    r = validate(job(tmp_path / "b", AgentRemoverOptions(srv.url, "scripted")))
    assert not r["ok"] and r["reason"] == "no hidden test fails after removal"
    assert not list((tmp_path / "a").iterdir()) and not list((tmp_path / "b").iterdir())


def test_malformed_tool_calls_get_error_observations(project, server, tmp_path):
    _, job, _ = project
    srv = server({"add": malformed})
    r = validate(job(tmp_path, AgentRemoverOptions(srv.url, "scripted")))
    assert not r["ok"] and not r["fatal"]
    assert "without changing any library file" in r["reason"]
    obs = [m["content"] for m in srv.requests[1]["messages"] if m["role"] == "tool"]
    assert len(obs) == 8 and all(o.startswith("error: ") for o in obs)
    for o, part in zip(
        obs,
        [
            "not valid JSON",
            "unknown tool 'explode'",
            "only existing library files",
            "expected a relative path",
            "expected integers",
            "occurs 3 times",
            "malformed tool call",
            "expected a JSON object",
        ],
        strict=True,
    ):
        assert part in o, (part, o)
    # the history sent back holds every call well-formed, with its answer under the same id
    sent = srv.requests[1]["messages"][2]["tool_calls"]
    assert all(isinstance(c["function"]["arguments"], str) and c["id"] for c in sent)
    answered = [m["tool_call_id"] for m in srv.requests[1]["messages"] if m["role"] == "tool"]
    assert answered == [c["id"] for c in sent]
    nudge = srv.requests[2]["messages"][-1]
    assert nudge["role"] == "user" and "no tool call" in nudge["content"]
    assert not list(tmp_path.iterdir())


def test_limits_and_broken_endpoints_reject_cleanly(project, server, tmp_path):
    _, job, _ = project
    srv = server({"add": lambda: [[call("list_dir")]]})
    r = validate(job(tmp_path, AgentRemoverOptions(srv.url, "scripted", max_turns=3)))
    assert not r["ok"] and r["reason"] == "agent remover did not call done within 3 turns"
    assert len(srv.requests) == 3
    srv = server({}, garbage=True)
    r = validate(job(tmp_path, AgentRemoverOptions(srv.url, "scripted")))
    assert r["fatal"] and "did not answer with a chat completion" in r["reason"]
    r = validate(job(tmp_path, AgentRemoverOptions(srv.url[:-3] + "/v2", "scripted")))
    assert r["fatal"] and "HTTP 404" in r["reason"]
    srv = server({}, status=400)  # e.g. this candidate's prompt is too long: only it is rejected
    r = validate(job(tmp_path, AgentRemoverOptions(srv.url, "scripted")))
    assert not r["ok"] and not r["fatal"] and "HTTP 400" in r["reason"]
    srv = server({}, delay=0.6)  # a slow answer rejects this candidate, not the build
    r = validate(job(tmp_path, AgentRemoverOptions(srv.url, "scripted", request_timeout=0.2)))
    assert not r["fatal"] and "gave no answer within 0.2s" in r["reason"]
    assert not list(tmp_path.iterdir())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_build_with_agent_remover_end_to_end(project, server, tmp_path):
    proj, _, _ = project
    srv = server({"add": correct_removal})
    opts = BuildOptions(
        max_tasks=1,
        max_candidates=10,
        timeout=120,
        remover="agent",
        agent=AgentRemoverOptions(srv.url, "scripted"),
    )
    summary = build(str(proj), tmp_path / "tasks", opts, log=lambda m: None)
    (task,) = read_tasks(tmp_path / "tasks")
    assert summary["accepted"] == 1 and task["feature"]["name"] == "add"
    assert task["provenance"]["strategy"] == "agent"
    # an unreachable endpoint stops the build with a clear error and leaves nothing behind
    from cadenza.cli.main import app

    out = tmp_path / "dead"
    res = CliRunner().invoke(
        app,
        [
            "tasks",
            "build",
            str(proj),
            "--out",
            str(out),
            "--remover",
            "agent",
            "--endpoint",
            f"http://127.0.0.1:{_closed_port()}/v1",
            "--model",
            "m",
            "--timeout",
            "120",
        ],
    )
    assert res.exit_code == 2
    assert "cannot reach the remover endpoint" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks"]
    with pytest.raises(TaskError, match="needs --endpoint URL and --model"):
        build(str(proj), out, BuildOptions(remover="agent"), log=lambda m: None)
    assert not out.exists()
