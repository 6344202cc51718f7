"""Malformed-output battery: every broken generation becomes a recorded assistant turn with
an error kind, followed by a turn whose observation tells the policy what went wrong."""

import json
from pathlib import Path

from agent_support import ScriptedPolicy, byte_tokenizer, local_run
from cadenza.agent.chat_format import CadenzaFormat
from cadenza.agent.runner import AgentTask, EpisodeRunner
from cadenza.config.agent import AgentConfig

TC, TE = "<|tool_call|>", "<|/tool_call|>"


def call(name, **args):
    return TC + json.dumps({"name": name, "arguments": args}) + TE


def raw(body):
    return TC + body + TE


RF = '{"name": "read_file", "arguments": {"path": "calc.py"}}'

# (label, generated reply, an expected error kind, a phrase expected in the observation)
BATTERY = [
    (
        "truncated json",
        raw('{"name": "read_file", "arguments": {"path": "calc.py"'),
        "malformed_json",
        "not valid JSON",
    ),
    (
        "truncated by length",
        ("length", TC + '{"name": "write_file", "arguments": {"path": "a.py", "content": "x'),
        "truncated",
        "not closed",
    ),
    ("unclosed, incomplete", TC + '{"name": "read_file", "argu', "unclosed_call", "not closed"),
    ("unclosed, complete json", TC + RF, "unclosed_call", "not closed with"),
    (
        "wrong type path",
        call("read_file", path=5),
        "invalid_arguments",
        "expected string, found integer",
    ),
    (
        "wrong type start_line str",
        call("read_file", path="calc.py", start_line="3"),
        "invalid_arguments",
        "start_line",
    ),
    (
        "wrong type start_line bool",
        call("read_file", path="calc.py", start_line=True),
        "invalid_arguments",
        "boolean",
    ),
    (
        "start_line below minimum",
        call("read_file", path="calc.py", start_line=0),
        "invalid_arguments",
        ">= 1",
    ),
    (
        "missing required",
        call("write_file", path="a.py"),
        "invalid_arguments",
        "missing required property 'content'",
    ),
    (
        "extra property",
        call("list_dir", path=".", recursive=True),
        "invalid_arguments",
        "unexpected properties",
    ),
    ("empty command", call("run", command=""), "invalid_arguments", "at least 1"),
    ("negative timeout", call("run", command="ls", timeout=-1), "invalid_arguments", ">= 1"),
    ("submit with junk", call("submit", x=1), "invalid_arguments", "unexpected properties"),
    (
        "arguments null",
        raw('{"name": "list_dir", "arguments": null}'),
        "invalid_arguments",
        "expected an object",
    ),
    (
        "arguments list",
        raw('{"name": "list_dir", "arguments": ["."]}'),
        "invalid_arguments",
        "found list",
    ),
    (
        "arguments bad string",
        raw('{"name": "list_dir", "arguments": "{path: ."}'),
        "invalid_arguments",
        "not a JSON object",
    ),
    (
        "openai nested bad args",
        raw('{"type": "function", "function": {"name": "read_file", "arguments": "{bad"}}'),
        "invalid_arguments",
        "not a JSON object",
    ),
    (
        "unknown tool",
        call("grep", pattern="x"),
        "unknown_tool",
        "Tool not found: grep. Available tools: list_dir,",
    ),
    (
        "unknown tool with space",
        call("read file", path="calc.py"),
        "unknown_tool",
        "Tool not found: read file.",
    ),
    (
        "unknown tool case",
        call("Read_File", path="calc.py"),
        "unknown_tool",
        "Tool not found: Read_File",
    ),
    (
        "nested unescaped quotes",
        raw('{"name": "write_file", "arguments": {"path": "a.py", "content": "print("hi")"}}'),
        "malformed_json",
        "not valid JSON",
    ),
    (
        "single quotes",
        raw("{'name': 'list_dir', 'arguments': {}}"),
        "malformed_json",
        "not valid JSON",
    ),
    (
        "trailing comma",
        raw('{"name": "list_dir", "arguments": {},}'),
        "malformed_json",
        "not valid JSON",
    ),
    ("trailing garbage", raw(RF + " and more"), "malformed_json", "Extra data"),
    ("deep nesting", raw("[" * 100000 + "]" * 100000), "malformed_json", "nested too deeply"),
    (
        "json array",
        raw('["read_file", {"path": "calc.py"}]'),
        "malformed_call",
        "must be a JSON object",
    ),
    ("name is a number", raw('{"name": 3, "arguments": {}}'), "malformed_call", 'needs "name"'),
    ("missing name", raw('{"arguments": {"path": "calc.py"}}'), "malformed_call", 'needs "name"'),
    ("empty call", raw(""), "malformed_call", "empty tool call"),
    ("whitespace call", raw(" \n\t "), "malformed_call", "empty tool call"),
    ("stray closing tag", RF + TE, "malformed_call", "without a matching"),
    ("nested opening tags", TC + TC + RF + TE, "unclosed_call", "not closed"),
    (
        "1 MB arguments",
        call("write_file", path="big.py", content="x" * 1_000_000),
        "oversized_call",
        "characters long",
    ),
    ("invalid utf-8 text", [b"caf\xc3 \xff\xfe"], "invalid_utf8", "not valid UTF-8"),
    (
        "invalid utf-8 in call",
        [TC, b'{"name": "write_file", "arguments": {"path": "a.py", "content": "\xff\xfe"}}', TE],
        "invalid_utf8",
        "not valid UTF-8",
    ),
    (
        "lone surrogate escape",
        raw('{"name": "write_file", "arguments": {"path": "a.py", "content": "\\ud800"}}'),
        "invalid_utf8",
        "unpaired surrogates",
    ),
    ("NUL in path", call("read_file", path="calc\u0000.py"), "invalid_arguments", "NUL"),
    (
        "too many calls",
        "".join(call("list_dir") for _ in range(20)),
        "too_many_calls",
        "only the first 16",
    ),
    (
        "several calls one unknown",
        call("list_dir") + call("frobnicate"),
        "unknown_tool",
        "Tool not found: frobnicate",
    ),
    (
        "several calls one malformed",
        call("list_dir") + raw("{oops"),
        "malformed_json",
        "Error in tool call 2",
    ),
    (
        "path escape relative",
        call("read_file", path="../../etc/passwd"),
        "path_outside_workspace",
        "outside the workspace",
    ),
    (
        "path escape absolute",
        call("write_file", path="/etc/evil", content="x"),
        "path_outside_workspace",
        "outside the workspace",
    ),
    ("missing file", call("read_file", path="nope.py"), "tool_failed", "not a file"),
    (
        "str_replace no match",
        call("str_replace", path="calc.py", old_str="zzz", new_str="y"),
        "tool_failed",
        "not found",
    ),
    (
        "write to a directory",
        call("write_file", path="tests", content="x"),
        "tool_failed",
        "is a directory",
    ),
    ("list a file", call("list_dir", path="calc.py"), "tool_failed", "not a directory"),
    ("empty", "", "empty_response", "Your reply was empty"),
    ("only whitespace", "  \n\t  \n", "empty_response", "Your reply was empty"),
    ("prose only", "I think mul should multiply.", "no_tool_call", "contained no tool call"),
    ("hermes tags", "<tool_call>" + RF + "</tool_call>", "no_tool_call", "contained no tool call"),
    ("markdown json", "```json\n" + RF + "\n```", "no_tool_call", "contained no tool call"),
    ("partial tag text", "<|tool_ca", "no_tool_call", "contained no tool call"),
]


def light_workspace(ws):
    ws.mkdir(parents=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (ws / "tests").mkdir()


def test_malformed_output_battery(tmp_path):
    assert len(BATTERY) >= 40
    tok = byte_tokenizer()
    policy = ScriptedPolicy(tok, [[reply] for _, reply, _, _ in BATTERY])
    cfg = AgentConfig(
        max_turns=1, max_new_tokens=2_000_000, max_episode_tokens=2_000_000, max_context=4_000_000
    )
    runner = EpisodeRunner(policy, CadenzaFormat(tok), cfg, run_command=local_run)
    task = AgentTask("battery", "Implement mul.", light_workspace)
    episodes = runner.run_group(task, len(BATTERY), tmp_path)
    assert policy.calls == [len(BATTERY)]
    failures = []
    for (label, _, kind, phrase), ep in zip(BATTERY, episodes):
        (a,) = ep.assistant_turns()
        turn = ep.turns[a]
        after = ep.turns[a + 1 :]
        observations = "\n".join(t.observation or "" for t in after)
        ok = (
            kind in turn.error_kinds
            and after
            and all(t.observation for t in after)
            and phrase in observations
            and ep.turns[-1].end == len(ep.token_ids)
            and sum(ep.policy_mask) > 0
        )
        if not ok:
            failures.append((label, turn.error_kinds, observations[:300]))
    assert not failures, failures
    # Nothing escaped the workspace or was written by a refused call.
    assert not (tmp_path / "etc").exists()
    by_label = dict(zip([b[0] for b in BATTERY], episodes))
    big = by_label["1 MB arguments"]
    assert not (Path(big.info["workspace"]) / "big.py").exists()
    unclosed = by_label["unclosed, complete json"]
    assert unclosed.turns[-2].tool_name == "read_file"  # complete call still ran
    assert "def add" in unclosed.turns[-2].observation


def test_every_battery_kind_is_a_declared_error_kind():
    from cadenza.agent import ERROR_KINDS

    assert {kind for _, _, kind, _ in BATTERY} <= set(ERROR_KINDS)
    assert len(set(ERROR_KINDS)) == len(ERROR_KINDS)
