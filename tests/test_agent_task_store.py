"""The harness on a real task from the task factory: `cadenza tasks build` output loaded as
AgentTasks, episodes run through the sandbox with the task's environment, graded by the task
factory's grader; and `cadenza eval` on the same store against a real `cadenza serve`."""

import json
import threading

import pytest
from typer.testing import CliRunner

from agent_support import ScriptedPolicy, byte_tokenizer, call, scripted_generate
from cadenza.agent.chat_format import CadenzaFormat
from cadenza.agent.runner import EpisodeRunner
from cadenza.agent.serve import ChatService, make_server
from cadenza.agent.task_source import load_task_store
from cadenza.cli.main import app
from cadenza.config.agent import AgentConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from cadenza.tasks.build import BuildOptions, build
    from test_tasks_build import make_project  # the task factory's own test project

    d = tmp_path_factory.mktemp("store")
    build(
        str(make_project(d / "proj")),
        d / "out",
        BuildOptions(max_tasks=1, timeout=120),
        log=lambda m: None,
    )
    return d / "out"


def unsafe():
    import cadenza.sandbox

    return not cadenza.sandbox.isolation().bwrap


def apply_gold(store):
    row = json.loads((store / "tasks.jsonl").read_text().splitlines()[0])
    return call(
        "run", command=f"git apply <<'CADENZA_EOF'\n{row['patch']}\nCADENZA_EOF\necho applied"
    )


def test_runner_on_a_task_factory_task(store, tmp_path):
    (task,) = load_task_store(store)
    tok = byte_tokenizer()
    solve = [apply_gold(store), call("run_tests"), call("submit")]
    policy = ScriptedPolicy(tok, [solve, [call("submit")]])
    cfg = AgentConfig(max_turns=4, max_new_tokens=8192, unsafe_sandbox=unsafe())
    solved, idle = EpisodeRunner(policy, CadenzaFormat(tok), cfg).run_group(task, 2, tmp_path / "w")
    assert "applied" in solved.turns[solved.assistant_turns()[0] + 1].observation
    tests_obs = solved.turns[solved.assistant_turns()[1] + 1].observation
    assert tests_obs.startswith("exit code: 0") and "passed" in tests_obs, tests_obs
    assert (solved.resolved, solved.reward, solved.finish_reason) == (True, 1.0, "submit")
    assert (idle.resolved, idle.reward) == (False, 0.0)
    assert solved.info["grade"]["resolved"] is True and idle.info["model_patch"] == ""


def test_eval_cli_on_a_task_factory_store(store, tmp_path):
    tok = byte_tokenizer()
    replies = [apply_gold(store), call("submit")]
    svc = ChatService(None, CadenzaFormat(tok), "gold", generate_fn=scripted_generate(tok, replies))
    server = make_server(svc, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    args = ["eval", str(store), "--endpoint", f"http://{host}:{port}/v1", "--model", "gold"]
    args += ["--out", str(tmp_path / "out"), "--max-turns", "3", "--max-tokens", "8192"]
    if unsafe():
        args.append("--unsafe-sandbox")
    try:
        r = CliRunner().invoke(app, args)
    finally:
        server.shutdown()
        server.server_close()
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (report["resolved"], report["instances"]) == (1, 1), report
    (pred,) = [
        json.loads(x) for x in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()
    ]
    assert pred["model_name_or_path"] == "gold" and pred["model_patch"].startswith("diff --git")
    # The predictions grade the same with the task factory's own CLI.
    r = CliRunner().invoke(
        app,
        [
            "tasks",
            "grade",
            str(store),
            "--predictions",
            str(tmp_path / "out" / "predictions.jsonl"),
            "--out",
            str(tmp_path / "g.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    graded = json.loads((tmp_path / "g.json").read_text())
    assert graded[pred["instance_id"]]["resolved"] is True
