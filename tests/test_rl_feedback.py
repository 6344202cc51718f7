"""Feedback providers on hand-built episodes; an OpenAI-compatible judge served locally."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from cadenza.agent.episode import Episode, ToolCall, Turn
from cadenza.rl import feedback as fb

TOOLS = {
    "bash": {"required": ["command"], "properties": {"command": {}}},
    "write_file": {"required": ["path", "content"], "properties": {"path": {}, "content": {}}},
}


def _episode(turns):
    return Episode(task_id="t", turns=turns)


def _a(*calls, text="", errors=()):
    return Turn("assistant", 0, 0, text=text, tool_calls=list(calls), error_kinds=list(errors))


def _tool(obs, errors=()):
    return Turn("tool", 0, 0, observation=obs, error_kinds=list(errors))


def test_unknown_tool_and_invalid_arguments():
    ep = _episode(
        [
            Turn("system", 0, 0, "sys"),
            _a(ToolCall("grep", {"q": "x"}, "grep q=x")),
            _tool("unknown tool grep", ["unknown_tool"]),
            _a(ToolCall("bash", None, "bash {oops")),
            _tool("bad args"),
            _a(ToolCall("bash", {"command": "ls"}, "")),
        ]
    )
    ctx = fb.FeedbackContext(tools=TOOLS)
    hints = fb.UnknownTool().hints(ep, ctx)
    assert [h.turn_index for h in hints] == [1]
    assert hints[0].text.startswith("Reminder: available tools: bash, write_file.")
    assert "grep does not exist" in hints[0].text
    inv = fb.InvalidArguments().hints(ep, ctx)
    assert [h.turn_index for h in inv] == [3]
    assert "could not be parsed" in inv[0].text and "command" in inv[0].text
    missing = _episode([_a(ToolCall("write_file", {"path": "a.py"}, ""))])
    assert "missing content" in fb.InvalidArguments().hints(missing, ctx)[0].text


def test_repeated_failure_only_after_a_failure():
    call = ToolCall("bash", {"command": "pytest"}, "")
    ep = _episode(
        [
            _a(call),
            _tool("ImportError: no module named foo\nexit code 1"),
            _a(ToolCall("bash", {"command": "ls"}, "")),
            _tool("a.py"),
            _a(call),
            _tool("ImportError again"),
            _a(ToolCall("bash", {"command": "ls"}, "")),  # repeated, but it succeeded before
        ]
    )
    hints = fb.RepeatedFailure().hints(ep, fb.FeedbackContext(tools=TOOLS))
    assert [h.turn_index for h in hints] == [4]
    assert "ImportError: no module named foo" in hints[0].text


def test_ruff_style_on_written_file_and_clean_skip(monkeypatch):
    bad = "import os\nx=1\n"
    ep = _episode(
        [
            _a(ToolCall("write_file", {"path": "m.py", "content": bad}, "")),
            _a(ToolCall("write_file", {"path": "ok.py", "content": "x = 1\n"}, "")),
            _a(ToolCall("write_file", {"path": "notes.txt", "content": bad}, "")),
        ]
    )
    ctx = fb.FeedbackContext(tools=TOOLS)
    hints = fb.RuffStyle().hints(ep, ctx)
    assert [h.turn_index for h in hints] == [0]
    assert "F401" in hints[0].text and "m.py" in hints[0].text
    monkeypatch.setattr(fb, "_ruff_command", lambda: None)
    assert fb.RuffStyle().hints(ep, ctx) == []


def test_overlong_and_annotate_merges_and_filters_leaks():
    patch = "--- a/m.py\n+++ b/m.py\n+def secret_feature(x):\n+    return compute_the_hidden_answer(x, y)\n"
    ep = _episode([_a(ToolCall("nope", {}, ""), text="y" * 50), _tool("unknown")])
    ctx = fb.FeedbackContext(tools=TOOLS, max_message_chars=10, hidden_patch=patch)

    class Leaky:
        name = "leaky"

        def hints(self, episode, ctx):
            return [
                fb.Hint(0, "Hint: return compute_the_hidden_answer(x, y)", self.name),
                fb.Hint(1, "targets a tool turn", self.name),
            ]

    class Broken:
        name = "broken"

        def hints(self, episode, ctx):
            raise RuntimeError("plugin bug")

    providers = fb.build_providers(["unknown_tool", "overlong"]) + [Leaky(), Broken()]
    hints, dropped = fb.annotate(ep, providers, ctx)
    assert len(hints) == 1 and hints[0].turn_index == 0
    assert hints[0].provider == "unknown_tool+overlong"
    assert "keep each message under 10" in hints[0].text
    assert dropped == {"leak": 1, "not_assistant": 1}
    assert ctx.errors == {"broken": 1}
    with pytest.raises(ValueError, match="unknown"):
        fb.build_providers(["nonexistent"])


def test_leak_filter():
    patch = "+++ b/x.py\n+    total = sum(item.price * item.qty for item in cart)\n"
    assert fb.leaks_answer("use total = sum(item.price * item.qty for item in cart)", patch)
    assert fb.leaks_answer("maybe sum(item.price * item.qty for item in", patch)  # 6-gram
    assert not fb.leaks_answer("Reminder: available tools: bash.", patch)
    assert not fb.leaks_answer("anything", "")


def test_teacher_margin_filter():
    keep, gain = fb.teacher_prefers_other([-0.1, -0.2], [-2.1, -0.2], margin=0.5)
    assert keep and gain == pytest.approx(1.0)
    keep, gain = fb.teacher_prefers_other([-0.1], [-0.15], margin=0.5)
    assert not keep and gain == pytest.approx(0.05)


def test_llm_judge_over_local_openai_compatible_server():
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["path"], seen["body"] = self.path, body
            content = (
                'Sure: {"hints": [{"turn": 0, "hint": "Use bash."}, {"turn": 1, "hint": "x"}]}'
            )
            out = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ep = _episode([_a(ToolCall("grep", {}, "grep")), _tool("unknown")])
        judge = fb.LLMJudge(f"http://127.0.0.1:{server.server_port}/v1", "judge-model")
        ctx = fb.FeedbackContext(tools=TOOLS)
        hints = judge.hints(ep, ctx)
        assert hints == [fb.Hint(0, "Use bash.", "llm_judge")]  # the tool-turn hint dropped
        assert seen["path"] == "/v1/chat/completions" and seen["body"]["model"] == "judge-model"
    finally:
        server.shutdown()
    dead = fb.LLMJudge("http://127.0.0.1:9/v1", "m", timeout=2)
    assert dead.hints(ep, ctx) == [] and ctx.errors == {"llm_judge": 1}
