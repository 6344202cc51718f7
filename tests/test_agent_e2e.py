"""End to end: the tiny cadenza model as a local policy, and the HTTP policy against a real
`cadenza serve` server on a free loopback port, each running graded episodes on a task
(a small repo with a hidden test, graded by its own independent grader)."""

import json
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from agent_support import (
    SOLVE,
    bpe_tokenizer,
    byte_tokenizer,
    call,
    grade_patch,
    make_workspace,
    scripted_generate,
)
from cadenza.agent.chat_format import CadenzaFormat
from cadenza.agent.policies import HTTPPolicy, LocalPolicy
from cadenza.agent.runner import AgentTask, EpisodeRunner
from cadenza.agent.serve import ChatService, load_service, make_server
from cadenza.config.agent import AgentConfig
from cadenza.config.model import ModelConfig

TC, TE = "<|tool_call|>", "<|/tool_call|>"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def ckpt(bpe, tmp_path_factory):
    from cadenza.model import CausalLM, save_pretrained

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=bpe.get_vocab_size(), num_hidden_layers=2, max_position_embeddings=16384
    )
    d = tmp_path_factory.mktemp("ckpt")
    save_pretrained(CausalLM(cfg), d)
    bpe.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|eos|>", "bos_token": "<|bos|>"})
    )
    return d


@pytest.fixture(scope="module")
def service(ckpt):
    return load_service(ckpt, "tiny", max_new_tokens=32)


def serve(service):
    server = make_server(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}/v1"


def task(tmp_path):
    return AgentTask(
        "calc-mul",
        "Implement mul(a, b) in calc.py.",
        make_workspace,
        grade=lambda patch: grade_patch(patch, tmp_path),
        test_command=(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
        ro_binds=(sys.prefix,),  # the interpreter's environment, read-only in the sandbox
    )


def _unsafe():
    import cadenza.sandbox

    return not cadenza.sandbox.isolation().bwrap  # without bubblewrap, say so explicitly


# Tools and the patch run in the real sandbox (cadenza.sandbox).
CFG = AgentConfig(max_turns=2, max_new_tokens=24, temperature=1.0, unsafe_sandbox=_unsafe())


def full_forward_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float()
    lp = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [0.0] + lp.tolist()  # logprob of token i given tokens < i


def check_logprobs(model, ep):
    ref = full_forward_logprobs(model, ep.token_ids)
    pos = [i for i, m in enumerate(ep.policy_mask) if m]
    assert pos, "the policy sampled nothing"
    got = torch.tensor([ep.behavior_logprobs[i] for i in pos])
    want = torch.tensor([ref[i] for i in pos])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_local_tiny_policy_runs_graded_episodes(service, tmp_path):
    fmt = service.fmt
    policy = LocalPolicy(service.model, fmt, temperature=1.0, seed=0)
    eps = EpisodeRunner(policy, fmt, CFG, run_command=None).run_group(
        task(tmp_path), 2, tmp_path / "w"
    )
    for ep in eps:
        assert ep.finish_reason in ("max_turns", "submit")
        assert "grade_error" not in ep.info and ep.resolved is False and ep.reward == 0.0
        assert len(ep.assistant_turns()) >= 1
        # Oracle: the recorded behaviour logprobs are the model's own on the recorded sequence.
        check_logprobs(service.model, ep)
        # Every assistant turn has an error kind (random weights write no valid call) and is
        # answered by a turn with an observation.
        for i in ep.assistant_turns():
            assert ep.turns[i].error_kinds
            assert ep.turns[i + 1].observation
    assert eps[0].token_ids != eps[1].token_ids  # the two samples differ


@pytest.mark.slow
def test_http_policy_against_cadenza_serve(service, tmp_path):
    server, url = serve(service)
    try:
        for stream in (False, True):
            policy = HTTPPolicy(
                url, "tiny", temperature=1.0, stream=stream, logprobs=True, extra_body={"seed": 3}
            )
            fmt = None if stream else service.fmt  # a client may know the server's format
            eps = EpisodeRunner(policy, fmt, CFG, run_command=None).run_group(
                task(tmp_path), 2, tmp_path / f"h{stream}"
            )
            for ep in eps:
                assert ep.finish_reason in ("max_turns", "submit"), ep.info.get("error")
                assert "grade_error" not in ep.info and ep.resolved is False
                # The server returned token ids; the client kept one consistent sequence whose
                # logprobs are the model's own (oracle: a full forward).
                assert ep.info["token_ids"] == "server"
                check_logprobs(service.model, ep)
                if fmt is not None:  # spans start at the generation prompt, as in local episodes
                    gp = fmt.generation_prompt_ids()
                    for i in ep.assistant_turns():
                        s = ep.turns[i].start
                        assert ep.token_ids[s : s + len(gp)] == gp
            if not stream:
                first = eps
        # Same seed, streamed or not: the same replies.
        assert [t.text for t in first[0].turns] == [t.text for t in eps[0].turns]
    finally:
        server.shutdown()
        server.server_close()


def test_http_tool_calls_resolve_a_task(tok, tmp_path):
    svc = ChatService(
        None, CadenzaFormat(tok), "scripted", generate_fn=scripted_generate(tok, SOLVE)
    )
    server, url = serve(svc)
    try:
        policy = HTTPPolicy(url, "scripted")
        (ep,) = EpisodeRunner(
            policy, None, AgentConfig(max_turns=5, unsafe_sandbox=_unsafe()), run_command=None
        ).run_group(task(tmp_path), 1, tmp_path / "s")
    finally:
        server.shutdown()
        server.server_close()
    assert (ep.finish_reason, ep.resolved, ep.reward) == ("submit", True, 1.0)
    assert [c.name for i in ep.assistant_turns() for c in ep.turns[i].tool_calls] == [
        "read_file",
        "str_replace",
        "run_tests",
        "submit",
    ]
    assert all(not ep.turns[i].error_kinds for i in ep.assistant_turns())


def post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + "/chat/completions", data, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read()


def test_serve_protocol(tok):
    replies = ["Sure." + call("list_dir", path=".") + call("run", command="ls")] * 2 + [
        "plain answer",
        TC + "{broken" + TE,
    ]
    svc = ChatService(None, CadenzaFormat(tok), "m", generate_fn=scripted_generate(tok, replies))
    server, url = serve(svc)
    try:
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "m"
        msgs = [{"role": "user", "content": "hi"}]
        tools = [
            {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object"}}}
        ]
        status, ctype, body = post(url, {"model": "m", "messages": msgs, "tools": tools})
        assert status == 200, body
        assert status == 200 and ctype == "application/json"
        r = json.loads(body)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Sure."
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["list_dir", "run"]
        assert json.loads(calls[1]["function"]["arguments"]) == {"command": "ls"}
        assert r["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert tok.decode(r["prompt_token_ids"], skip_special_tokens=False).endswith(
            "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n"
        )
        # Streaming: server-sent chunks that assemble to the same message.
        status, ctype, body = post(url, {"model": "m", "messages": msgs, "stream": True})
        assert status == 200 and ctype == "text/event-stream"
        events = [ln[6:] for ln in body.decode().split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        names = [
            tc["function"]["name"]
            for c in chunks
            for tc in c["choices"][0]["delta"].get("tool_calls") or []
            if tc["function"].get("name")
        ]
        assert text == "Sure." and names == ["list_dir", "run"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # No call: plain content; a broken call: the raw text, for the client's harness.
        r = json.loads(post(url, {"messages": msgs})[2])
        assert r["choices"][0]["message"] == {"role": "assistant", "content": "plain answer"}
        assert r["choices"][0]["finish_reason"] == "stop"
        r = json.loads(post(url, {"messages": msgs})[2])
        assert r["choices"][0]["message"]["content"] == TC + "{broken" + TE
        # Bad requests: OpenAI-style errors.
        for body, raw, code, phrase in [
            (None, b"{not json", 400, "not valid JSON"),
            ({"model": "other", "messages": msgs}, None, 404, "serves 'm'"),
            ({"messages": []}, None, 400, "non-empty list"),
            ({"messages": msgs, "n": 2}, None, 400, "n=1"),
            ({"messages": msgs, "temperature": 9}, None, 400, "temperature"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "role"),
            ({"messages": msgs, "max_tokens": 0}, None, 400, "max_tokens"),
        ]:
            status, _, out = post(url, body, raw)
            err = json.loads(out)["error"]
            assert status == code and phrase in err["message"], (body, err)
    finally:
        server.shutdown()
        server.server_close()
