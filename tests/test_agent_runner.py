import json
import sys

import pytest

from agent_support import ScriptedPolicy, byte_tokenizer, grade_patch, local_run, make_workspace
from cadenza.agent.chat_format import CadenzaFormat
from cadenza.agent.runner import AgentTask, EpisodeRunner
from cadenza.config.agent import AgentConfig

TC, TE = "<|tool_call|>", "<|/tool_call|>"


def call(name, **args):
    return TC + json.dumps({"name": name, "arguments": args}) + TE


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def task(tmp_path, grade=True):
    return AgentTask(
        "calc-mul",
        "Implement mul(a, b) in calc.py.",
        make_workspace,
        grade=(lambda patch: grade_patch(patch, tmp_path)) if grade else None,
        test_command=(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
    )


def runner(tok, script, **cfg):
    policy = ScriptedPolicy(tok, script)
    cfg = AgentConfig(**{"max_new_tokens": 4096, **cfg})
    return policy, EpisodeRunner(policy, CadenzaFormat(tok), cfg, run_command=local_run)


SOLVE = [
    "Let me look." + call("read_file", path="calc.py"),
    call(
        "str_replace", path="calc.py", old_str="raise NotImplementedError", new_str="return a * b"
    ),
    call("run_tests"),
    call("submit"),
]
IDLE = ["thinking", call("list_dir"), call("submit")]


def test_group_is_batched_recorded_and_graded(tok, tmp_path):
    policy, r = runner(tok, [SOLVE, IDLE])
    eps = r.run_group(task(tmp_path), 2, tmp_path / "work")
    assert policy.calls == [2, 2, 2, 1]  # one generate call per turn for all live episodes
    solved, idle = eps
    assert (solved.resolved, solved.reward, solved.finish_reason) == (True, 1.0, "submit")
    assert (idle.resolved, idle.reward, idle.finish_reason) == (False, 0.0, "submit")
    assert "+    return a * b" in solved.info["model_patch"]
    assert idle.info["model_patch"] == ""
    assert idle.turns[2].error_kinds == ["no_tool_call"]
    assert "contained no tool call" in idle.turns[3].observation
    for ep in eps:
        # Turn spans tile the sequence; the decoded spans are the messages as rendered.
        assert ep.turns[0].start == 0 and ep.turns[-1].end == len(ep.token_ids)
        assert all(a.end == b.start for a, b in zip(ep.turns, ep.turns[1:]))
        # Policy tokens are exactly the sampled ones, with their logprobs.
        sampled = [
            t for turn in ep.turns if turn.role == "assistant" for t in range(turn.start, turn.end)
        ]
        mask_idx = [i for i, m in enumerate(ep.policy_mask) if m]
        assert set(mask_idx) <= set(sampled)
        assert all(ep.behavior_logprobs[i] == -0.5 for i in mask_idx)
        assert all(
            ep.behavior_logprobs[i] == 0.0
            for i in range(len(ep.token_ids))
            if not ep.policy_mask[i]
        )
    text = tok.decode(solved.token_ids, skip_special_tokens=False)
    a0 = solved.turns[2]
    assert tok.decode(solved.token_ids[a0.start : a0.end], skip_special_tokens=False) == (
        "<|im_start|>assistant\nLet me look."
        '<|tool_call|>{"name": "read_file", "arguments": {"path": "calc.py"}}<|/tool_call|><|im_end|>'
    )
    assert [m for m, i in zip(solved.policy_mask, range(a0.start, a0.end)) if True]
    assert solved.policy_mask[a0.start] is False and solved.policy_mask[a0.end - 1] is True
    assert "<|im_start|>tool\n<|tool_result|>1\tdef add(a, b):" in text
    assert solved.turns[3].role == "tool" and solved.turns[3].tool_name == "read_file"
    assert "1 passed" in solved.turns[7].observation


def test_limits(tok, tmp_path):
    loop = [call("list_dir")] * 10
    _, r = runner(tok, [loop], max_turns=3)
    (ep,) = r.run_group(task(tmp_path, grade=False), 1, tmp_path / "w1")
    assert ep.finish_reason == "max_turns" and len(ep.assistant_turns()) == 3
    _, r = runner(tok, [loop], max_new_tokens=10, max_turns=10)
    (ep,) = r.run_group(task(tmp_path, grade=False), 1, tmp_path / "w2")
    assert sum(ep.policy_mask) == 10 * 10 and ep.finish_reason == "max_turns"
    assert all("truncated" in ep.turns[i].error_kinds for i in ep.assistant_turns())
    _, r = runner(tok, [loop], max_episode_tokens=60, max_turns=10)
    (ep,) = r.run_group(task(tmp_path, grade=False), 1, tmp_path / "w3")
    assert ep.finish_reason == "max_tokens" and sum(ep.policy_mask) <= 60
    fmt = CadenzaFormat(tok)
    cfg = AgentConfig()
    prompt, _ = fmt.prompt_ids(
        [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": "x"}],
        r.toolbox.schemas(),
    )
    limit = len(prompt) + 400
    _, r = runner(tok, [loop], max_context=limit, max_turns=10)
    (ep,) = r.run_group(task(tmp_path, grade=False), 1, tmp_path / "w4")
    assert ep.finish_reason == "context" and len(ep.token_ids) <= limit
    assert len(ep.assistant_turns()) >= 2


def test_unreachable_endpoint_ends_the_episode_with_an_error(tmp_path):
    import socket

    from cadenza.agent.policies import HTTPPolicy

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = HTTPPolicy(f"http://127.0.0.1:{port}/v1", "m", timeout=5)
    r = EpisodeRunner(policy, None, AgentConfig(), run_command=local_run)
    (ep,) = r.run_group(task(tmp_path, grade=False), 1, tmp_path / "w")
    assert ep.finish_reason == "error" and "cannot reach" in ep.info["error"]
    assert ep.turns[-1].error_kinds == ["policy_error"]
