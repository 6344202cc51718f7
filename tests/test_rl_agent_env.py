"""RL on the agent harness: rollouts of a tiny CausalLM on a real task-factory store.

Oracles: the chat format re-encoding the recorded conversation (token arrays), a full
forward of the policy (behavior logprobs), the task factory's grader on the gold patch
(rewards), and an uninterrupted run (resume)."""

import copy
import json
import random

import pytest
import torch
import torch.nn.functional as F

from agent_support import bpe_tokenizer, call
from cadenza.agent.chat_format import CadenzaFormat, insert_message_before, load_chat_format
from cadenza.config import ConfigError, load_config
from cadenza.config.agent import AgentConfig
from cadenza.config.model import ModelConfig
from cadenza.model import CausalLM, Generation, from_pretrained, generate
from cadenza.rl.agent_env import AgentEnv, pick_tasks, reward_of
from cadenza.rl.teacher import build_teacher_input
from cadenza.train.rl_trainer import CKPT_NAME, RLTrainer, build_policy, run_rl_job

TOOLS = ["run", "submit"]  # a short tools block keeps the tiny model's sequences short


# -- pure parts ---------------------------------------------------------------------------
def test_pick_tasks_round_robin_resumes_and_random_is_seeded():
    rng = random.Random(0)
    assert pick_tasks(3, 2, 0, "round_robin", rng) == ([0, 1], 2)
    assert pick_tasks(3, 2, 2, "round_robin", rng) == ([2, 0], 4)
    a = pick_tasks(5, 6, 0, "random", random.Random(7))
    b = pick_tasks(5, 6, 0, "random", random.Random(7))
    assert a == b and a[1] == 6 and all(0 <= i < 5 for i in a[0])
    with pytest.raises(ValueError, match="no tasks"):
        pick_tasks(0, 1, 0, "round_robin", rng)


def test_reward_kinds():
    report = {"resolved": False, "pass_fraction": 0.75, "fail_to_pass_passed": 1}
    assert reward_of(report, "resolved", 2) == 0.0
    assert reward_of(report, "pass_fraction", 2) == 0.75
    assert reward_of(report, "fail_to_pass_fraction", 2) == 0.5


def test_config_needs_a_task_store():
    with pytest.raises(ConfigError, match="rl.tasks_dir"):
        load_config("tiny", ["train.mode=rl", "rl.env=agent"])
    with pytest.raises(ConfigError, match="rl.reward"):
        load_config("tiny", ["rl.reward=vibes"])


# -- on a real task store -----------------------------------------------------------------
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


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def unsafe():
    import cadenza.sandbox

    return not cadenza.sandbox.isolation().bwrap


def tiny_cfg(vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        initializer_range=0.2,  # a random model that reacts to its context (a hint)
    )


def full_forward_logprobs(model, ids, temperature):
    """log softmax(logits / T) of each token given the ones before it (0 for token 0)."""
    with torch.no_grad():
        model.eval()
        logits = model(torch.tensor([ids]))
        logits = getattr(logits, "logits", logits)[0].float() / temperature
        model.train()
    lp = F.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def reencoded(ep, fmt, env):
    """The conversation rebuilt from the episode's messages by the chat format."""
    messages = []
    for t in ep.turns:
        if t.role == "assistant":
            body = [
                i for i, m in zip(ep.token_ids[t.start : t.end], ep.policy_mask[t.start :]) if m
            ]
            messages.append({"role": "assistant", "content": t.text, "token_ids": body})
        else:
            messages.append({"role": t.role, "content": t.text})
    return fmt.encode_conversation(messages, env.toolbox.schemas(), add_generation_prompt=False)


def check_episode(ep, fmt, env, model, temperature):
    n = len(ep.token_ids)
    assert len(ep.policy_mask) == len(ep.behavior_logprobs) == n
    assert reencoded(ep, fmt, env) == ep.token_ids
    spans = [(t.start, t.end) for t in ep.turns]
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sampled = {i for t in ep.turns if t.role == "assistant" for i in range(t.start, t.end)}
    assert all(i in sampled for i in range(n) if ep.policy_mask[i])
    lp = full_forward_logprobs(model, ep.token_ids, temperature)
    mask = torch.tensor(ep.policy_mask)
    behavior = torch.tensor(ep.behavior_logprobs)
    assert mask.any()
    torch.testing.assert_close(behavior[mask], lp[mask], atol=1e-4, rtol=0)
    assert (behavior[~mask] == 0).all()


@pytest.mark.slow
def test_rollout_with_the_sampler(store, tok, tmp_path):
    """The real sampler at T = 0.7: token arrays, logprobs and grading line up."""
    torch.manual_seed(0)
    fmt = CadenzaFormat(tok)
    model = CausalLM(tiny_cfg(fmt.vocab_size))
    agent = AgentConfig(max_turns=2, max_new_tokens=6, unsafe_sandbox=unsafe())
    batches = []

    def counted(model, prompts, **kw):
        batches.append(len(prompts))
        return generate(model, prompts, **kw)

    env = AgentEnv(
        store, fmt, agent, temperature=0.7, tools=TOOLS, workdir=tmp_path, generate_fn=counted
    )
    tasks = env.sample_tasks(2, random.Random(0))  # the store's one task, twice
    groups = env.rollout(model, tasks, 2, torch.Generator().manual_seed(0))
    assert [len(g) for g in groups] == [2, 2] and env.position == 2
    assert batches == [4, 4]  # one sampler call per turn for both groups
    for ep in groups[0] + groups[1]:
        check_episode(ep, fmt, env, model, 0.7)
        assert len(ep.assistant_turns()) == 2  # nothing random is a call to submit
        assert ep.info["grade"]["resolved"] is False and ep.reward == 0.0
    assert not list(tmp_path.iterdir())  # workspaces removed


def forced_generate(tok, scripts):
    """A generate_fn that emits scripted replies (episode e's reply at turn t) and records
    the policy model's own logprobs of them (a full forward): an on-policy record of
    off-distribution text, so a random tiny model makes the calls the test needs."""
    fmt = CadenzaFormat(tok)
    gp = fmt.generation_prompt_ids()
    end = tok.token_to_id("<|im_end|>")

    def turn_of(prompt):
        return sum(prompt[i : i + len(gp)] == gp for i in range(len(prompt))) - 1

    def generate(model, prompts, max_new_tokens, temperature, top_p, stop_tokens, seed):
        t = turn_of(prompts[0])
        live = [e for e in range(len(scripts)) if len(scripts[e]) > t]
        out = []
        for e, prompt in zip(live, prompts):
            assert turn_of(prompt) == t
            ids = tok.encode(scripts[e][t], add_special_tokens=False).ids + [end]
            lp = full_forward_logprobs(model, prompt + ids, temperature)[len(prompt) :]
            out.append(Generation(ids, lp.tolist(), "stop", lp.tolist()))
        return out

    return generate


def gold_call(store):
    row = json.loads((store / "tasks.jsonl").read_text().splitlines()[0])
    return call("run", command=f"git apply <<'CADENZA_EOF'\n{row['patch']}\nCADENZA_EOF\n")


def rl_setup(store, tok, tmp_path, model):
    fmt = CadenzaFormat(tok)
    scripts = [
        [call("grep", pattern="mean"), gold_call(store), call("submit")],  # solves it
        [call("grep", pattern="mean"), call("submit")],  # gives up
    ]
    agent = AgentConfig(max_turns=3, max_new_tokens=1024, unsafe_sandbox=unsafe())
    env = AgentEnv(
        store, fmt, agent, tools=TOOLS, generate_fn=forced_generate(tok, scripts), workdir=tmp_path
    )
    cfg = load_config(
        "tiny",
        [
            "train.mode=rl",
            f"train.out_dir={tmp_path / 'run'}",
            "rl.tasks_per_step=1",
            "rl.group_size=2",
            "rl.lr=1e-2",
            "rl.feedback.providers=[unknown_tool]",
            "rl.max_context=4096",
        ],
    )
    return RLTrainer(cfg, model, env), env, fmt


@pytest.mark.slow
def test_rl_steps_on_agent_episodes(store, tok, tmp_path):
    torch.manual_seed(0)
    start = CausalLM(tiny_cfg(len(tok.get_vocab())))
    trainer, env, fmt = rl_setup(store, tok, tmp_path, copy.deepcopy(start))
    seen = []
    rollout = env.rollout
    env.rollout = lambda *a: seen.append(rollout(*a)) or seen[-1]
    before = copy.deepcopy(trainer.model.state_dict())

    m = trainer.train_step()
    (solved, idle) = seen[0][0]
    # rewards from the task factory's grader on the final workspaces
    assert (solved.reward, solved.resolved, idle.reward) == (1.0, True, 0.0)
    for ep in (solved, idle):
        check_episode(ep, fmt, env, before_model(start, before), 1.0)
        first = ep.turns[ep.assistant_turns()[0]]
        assert "unknown_tool" in first.error_kinds
    # the hint on the unknown-tool turn, inserted by the agent chat format
    k = solved.assistant_turns()[0]
    text = "Reminder: available tools: run, submit. (grep does not exist)"
    hint = env.render_hint(text, solved, k)
    inserted, _ = insert_message_before(solved, k, "user", text, fmt)
    t_in = build_teacher_input(solved, k, hint)
    assert t_in.ids == inserted[: solved.turns[k].end + len(hint)]
    assert fmt.decode(hint).count(text) == 1
    # both unknown-tool turns hinted, with a nonzero KL; the RL term is live; weights move
    assert m["hinted_by_provider"] == {"unknown_tool": 2} and m["hint_kl_mean"] > 1e-3
    assert m["self_test"] == {"kl": 0.0, "grad": 0.0}
    assert m["groups_kept"] == 1 and m["rl_tokens"] > 0 and m["reward"] == 0.5
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)

    # resume: the checkpoint after step 1 continues exactly (weights, env position)
    trainer.save_checkpoint()
    m2 = trainer.train_step()
    resumed, env2, _ = rl_setup(store, tok, tmp_path, copy.deepcopy(start))
    assert resumed.load_checkpoint() and env2.position == 1
    r2 = resumed.train_step()
    assert env2.position == env.position == 2
    for key in ("loss", "reward", "hint_kl_mean", "rl_loss"):
        assert r2[key] == pytest.approx(m2[key], abs=1e-6), key
    for n, w in trainer.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[n], w, atol=1e-6, rtol=0)


def before_model(start, state):
    model = copy.deepcopy(start)
    model.load_state_dict(state)
    return model


@pytest.mark.slow
def test_run_rl_job_with_the_agent_env(store, tok, tmp_path):
    """`train.mode=rl rl.env=agent` from config: a fresh model.* policy with tokenizer.path."""
    tok.save(str(tmp_path / "tokenizer.json"))
    v = len(tok.get_vocab())
    args = [
        "train.mode=rl",
        "train.steps=1",
        "train.threads=1",
        f"train.out_dir={tmp_path / 'run'}",
        "rl.env=agent",
        f"rl.tasks_dir={store}",
        f"tokenizer.path={tmp_path / 'tokenizer.json'}",
        f"model.vocab_size={v}",
        "model.num_hidden_layers=2",
        "rl.tasks_per_step=1",
        "rl.group_size=2",
        "rl.tools=[run, submit]",
        "agent.max_turns=1",
        "agent.max_new_tokens=4",
        f"agent.unsafe_sandbox={str(unsafe()).lower()}",
    ]
    trainer = run_rl_job(load_config("tiny", args), quiet=True)
    assert trainer.env.name == "agent" and trainer.step == 1
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["reward"] == 0.0 and row["episode_tokens"] > 0
    state = torch.load(tmp_path / "run" / CKPT_NAME, weights_only=False)
    assert state["env"] == {"position": 1}
    # the trained policy exported for `cadenza serve` / eval / a next rl.init_from
    policy = from_pretrained(tmp_path / "run" / "policy")
    for n, w in trainer.model.state_dict().items():
        torch.testing.assert_close(policy.state_dict()[n], w, atol=0, rtol=0)
    assert isinstance(load_chat_format(tmp_path / "run" / "policy"), CadenzaFormat)
    small = load_config("tiny", [*args, "model.vocab_size=300"])
    with pytest.raises(ValueError, match=f"model.vocab_size={v}"):
        build_policy(small, trainer.env)
