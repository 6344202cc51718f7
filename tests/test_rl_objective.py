"""Toy environment records, the batch objective's gradient, and the ablation's bookkeeping."""

import random
import struct
import zlib

import pytest
import torch

from cadenza.bench.feedback import run as bench_run
from cadenza.bench.feedback import steps_to_threshold
from cadenza.config.rl import RLConfig
from cadenza.rl.feedback import FeedbackContext, UnknownTool, annotate
from cadenza.rl.objective import episode_metrics, rl_objective
from cadenza.rl.toy_env import VOCAB, ToyEnv, ToyPolicy, render_hint


def _rollout(seed=0, tasks=3, group=4):
    torch.manual_seed(seed)
    model = ToyPolicy(dim=16)
    env = ToyEnv()
    groups = env.rollout(
        model,
        env.sample_tasks(tasks, random.Random(seed)),
        group,
        torch.Generator().manual_seed(seed),
    )
    return model, env, groups


def test_toy_episodes_mask_only_sampled_tokens_with_on_policy_logprobs():
    model, env, groups = _rollout()
    for g in groups:
        for e in g:
            ids = torch.tensor([e.token_ids])
            lp = model(ids)[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            for i, m in enumerate(e.policy_mask):
                role = next(t.role for t in e.turns if t.start <= i < t.end)
                if m:
                    assert role == "assistant" and VOCAB[e.token_ids[i - 1]] != "<end>"
                    assert e.behavior_logprobs[i] == pytest.approx(lp[i - 1].item(), abs=1e-5)
                else:
                    assert e.behavior_logprobs[i] == 0.0
            assert sum(e.policy_mask) == 3  # tool name, argument, answer
            call = e.turns[2].tool_calls[0]
            assert ("unknown_tool" in e.turns[2].error_kinds) == (
                call.name not in ("calc", "lookup")
            )


def test_objective_gradient_is_group_baselined_policy_gradient():
    model, env, groups = _rollout(tasks=3, group=4)
    for e in groups[0]:
        e.reward = 1.0  # an all-equal group: dynamic sampling drops it
    for k, e in enumerate(groups[1]):
        e.reward = float(k % 2)
    for k, e in enumerate(groups[2]):
        e.reward = float(k == 0)
    cfg = RLConfig(normalize_std=False)
    out = rl_objective(model, groups, cfg)
    assert out.metrics["groups_kept"] == 2
    (g_obj,) = torch.autograd.grad(out.loss, [model.head.bias])
    # Oracle: on-policy (ratio 1, unclipped), token-mean loss = -(1/N) sum_b A_b sum_t logp_bt
    surrogate, n = 0.0, 0
    for g in groups[1:]:
        mean = sum(e.reward for e in g) / len(g)
        for e in g:
            ids = torch.tensor([e.token_ids])
            lp = model(ids)[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            m = torch.tensor(e.policy_mask[1:])
            surrogate = surrogate - (e.reward - mean) * lp[m].sum()
            n += int(m.sum())
    (g_ref,) = torch.autograd.grad(surrogate / n, [model.head.bias])
    torch.testing.assert_close(g_obj, g_ref, rtol=1e-4, atol=1e-7)


def test_hinted_episode_in_dropped_group_still_gets_kl():
    model, env, groups = _rollout(tasks=1, group=2)
    for e in groups[0]:
        e.reward = 1.0
    e = groups[0][0]
    hint_text = UnknownTool.hint_text(("calc", "lookup"), [])
    from cadenza.rl.feedback import Hint

    hints = {(0, 0): [(Hint(2, hint_text, "unknown_tool"), render_hint(hint_text))]}
    out = rl_objective(model, groups, RLConfig(), hints)
    assert out.metrics["groups_kept"] == 0 and out.metrics["rl_tokens"] == 0
    assert out.metrics["hint_spans"] == 1 and out.metrics["hint_tokens"] == 2
    assert out.loss.item() > 0
    assert out.metrics["hinted_by_provider"] == {"unknown_tool": 1}
    found, _ = annotate(e, [UnknownTool()], FeedbackContext(tools={"calc": {}, "lookup": {}}))
    assert [h.turn_index for h in found] == ([2] if e.turns[2].error_kinds else [])
    assert set(episode_metrics(groups[0])) == {"reward", "invalid_call_rate", "episode_tokens"}


def test_steps_to_threshold():
    assert steps_to_threshold([0.5, 0.0, 0.02, 0.0, 0.0], 0.01, min_window=2) == 3
    assert steps_to_threshold([0.0, 0.0], 0.01) == 0
    assert steps_to_threshold([0.0, 0.3], 0.01) is None
    assert steps_to_threshold([0.5] * 20 + [0.0] * 5, 0.01) is None  # a dip at the very end
    assert steps_to_threshold([0.5] * 20 + [0.0] * 10, 0.01) == 20


def _read_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(tag + body)
        chunks[tag] = chunks.get(tag, b"") + body
        pos += 12 + n
    w, h = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    return w, h, raw


def test_bench_feedback_smoke(tmp_path):
    png = tmp_path / "plot.png"
    r = bench_run(
        ["--steps", "3", "--tasks", "2", "--group", "4", "--warmup-steps", "3", "--png", str(png)]
    )
    for arm in ("rl_only", "rl_feedback"):
        assert set(r[arm]) >= {"steps_to_threshold", "final_reward"}
        assert len(r[arm]["invalid_call_rate"]) == 3
    assert r["rl_only"]["invalid_call_rate"][0] == r["rl_feedback"]["invalid_call_rate"][0]
    assert sum(r["rl_only"]["hint_spans"]) == 0
    for path in (png, tmp_path / "plot_reward.png"):
        w, h, raw = _read_png(path)
        assert (w, h) == (720, 440)
        assert len(set(raw)) > 2  # something was drawn


def test_one_feedback_step_with_the_cadenza_model(tmp_path):
    from cadenza.config import load_config
    from cadenza.train.rl_trainer import RLTrainer, build_env, build_policy

    cfg = load_config(
        "tiny",
        [
            "train.mode=rl",
            "rl.policy=causal_lm",
            "rl.warmup_steps=0",
            "rl.tasks_per_step=4",
            "rl.group_size=4",
            f"train.out_dir={tmp_path}",
        ],
    )
    env = build_env(cfg)
    trainer = RLTrainer(cfg, build_policy(cfg, env), env)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_step()
    assert m["self_test"] == {"kl": 0.0, "grad": 0.0}
    assert m["hint_spans"] > 0 and m["hint_skipped"] == {}
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
