"""`cadenza eval`: episodes against an endpoint (a real `cadenza serve` replaying a scripted
model), SWE-bench predictions and a report. The task store is stood in for by the test's own
task (the task factory's loader is replaced)."""

import json
import sys
import threading

from typer.testing import CliRunner

from agent_support import byte_tokenizer, grade_patch, local_run, make_workspace
from cadenza.agent.chat_format import CadenzaFormat
from cadenza.agent.runner import AgentTask
from cadenza.agent.serve import ChatService, make_server
from cadenza.cli.main import app
from test_agent_e2e import SOLVE, scripted_generate


def test_eval_writes_predictions_and_report(tmp_path, monkeypatch):
    import cadenza.agent.runner as runner_mod
    import cadenza.agent.task_source as task_source

    tok = byte_tokenizer()
    svc = ChatService(
        None,
        CadenzaFormat(tok),
        "scripted",
        generate_fn=scripted_generate(tok, SOLVE + ["no call here"] * 4),
    )
    server = make_server(svc, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/v1"

    def fake_store(store, ids=None):
        mk = lambda i: AgentTask(  # noqa: E731
            i,
            "Implement mul(a, b) in calc.py.",
            make_workspace,
            grade=lambda patch: grade_patch(patch, tmp_path),
            test_command=(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
        )
        return [mk("calc-1"), mk("calc-2")]

    monkeypatch.setattr(task_source, "load_task_store", fake_store)
    import cadenza.sandbox

    monkeypatch.setattr(cadenza.sandbox, "run", local_run, raising=False)
    store = tmp_path / "store"
    store.mkdir()
    (store / "tasks.jsonl").write_text("")
    out = tmp_path / "out"
    try:
        r = CliRunner().invoke(
            app,
            [
                "eval",
                str(store),
                "--endpoint",
                url,
                "--model",
                "scripted",
                "--out",
                str(out),
                "--max-turns",
                "4",
            ],
        )
    finally:
        server.shutdown()
        server.server_close()
    assert r.exit_code == 0, r.output
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["instance_id"] for p in preds] == ["calc-1", "calc-2"]
    assert all(p["model_name_or_path"] == "scripted" for p in preds)
    assert "+    return a * b" in preds[0]["model_patch"] and preds[1]["model_patch"] == ""
    report = json.loads((out / "report.json").read_text())
    assert report["resolved"] == 1 and report["instances"] == 2
    assert report["per_instance"]["calc-1"]["finish_reason"] == "submit", json.dumps(report)
    assert report["per_instance"]["calc-2"]["error_kinds"] == {"no_tool_call": 4}
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert episodes[0]["resolved"] is True
    assert runner_mod  # the runner was used through the CLI


def test_eval_bad_input(tmp_path):
    r = CliRunner().invoke(
        app, ["eval", str(tmp_path), "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"]
    )
    assert r.exit_code == 2 and "tasks.jsonl not found" in r.output
    (tmp_path / "tasks.jsonl").write_text("")
    r = CliRunner().invoke(app, ["eval", str(tmp_path), "--endpoint", "ftp://x", "--model", "m"])
    assert r.exit_code == 2 and "expected an http(s) URL" in r.output
