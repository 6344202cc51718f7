"""`cadenza bench feedback`: RL only vs RL + targeted text feedback, from the same start.

The toy tool-use environment (rl/toy_env.py) makes invalid tool calls cheap in final reward:
after a call to a tool that does not exist, the warmed-up policy still answers correctly from
memory most of the time. Both arms start from the same warmed-up weights and see the same
tasks and sampling seeds; they differ only in `rl.feedback.enabled`.

Figures per arm: `steps_to_threshold` (first step from which the invalid-call rate stays below
the threshold, 1% by default, until the end of the run, with at least 10 steps left to show
it; null if never) and `final_reward`
(mean reward over the last 10 steps); `final_invalid_call_rate` likewise.
The baseline is the RL-only arm; the ratio printed is steps_to_threshold(rl_only) /
steps_to_threshold(rl_feedback). Plots (cadenza.log.plot): the invalid-call rate per step at
--png, the reward per step next to it (`*_reward.png`), one line per arm.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from cadenza.config import load_config
from cadenza.log.plot import line_plot_png
from cadenza.train.rl_trainer import RLTrainer, build_env, build_policy


def steps_to_threshold(rates: list[float], threshold: float, min_window: int = 10) -> int | None:
    """First step s with rates[t] < threshold for every t >= s, None if there is none or if
    fewer than `min_window` steps follow s (a dip in the last few steps of a run is not
    "stays below")."""
    first = None
    for s, r in enumerate(rates):
        if r < threshold:
            first = s if first is None else first
        else:
            first = None
    if first is None or len(rates) - first < min(min_window, len(rates)):
        return None
    return first


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cadenza bench feedback", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--tasks", type=int, default=32, help="tasks per step")
    p.add_argument("--group", type=int, default=8, help="episodes per task (G)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--kl-coef", type=float, default=4.0)
    p.add_argument("--estimator", default="reverse_kl")
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--threshold", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="gru", choices=["gru", "causal_lm"])
    p.add_argument("--teacher", default="current", choices=["current", "ema", "frozen"])
    p.add_argument("--png", default="runs/bench_feedback.png")
    return p.parse_args(argv)


def run(argv: list[str]) -> dict:
    a = _parse(argv)
    torch.set_num_threads(1)
    base = [
        "train.mode=rl",
        f"train.seed={a.seed}",
        f"rl.tasks_per_step={a.tasks}",
        f"rl.group_size={a.group}",
        f"rl.lr={a.lr}",
        f"rl.warmup_steps={a.warmup_steps}",
        f"rl.policy={a.policy}",
        f"rl.feedback.teacher={a.teacher}",
        f"rl.feedback.kl_coef={a.kl_coef}",
        f"rl.feedback.estimator={a.estimator}",
        # the toy policy was taught to follow only this hint; a hint a model cannot use makes
        # a teacher that is no better than the student (and self-distilling it is harmful)
        "rl.feedback.providers=[unknown_tool]",
    ]
    cfg = load_config("tiny", base)
    env = build_env(cfg)
    t0 = time.perf_counter()
    start = build_policy(cfg, env)
    warm_s = time.perf_counter() - t0
    result: dict = {"config": vars(a), "warmup_s": warm_s}
    for arm, enabled in (("rl_only", False), ("rl_feedback", True)):
        arm_cfg = load_config("tiny", [*base, f"rl.feedback.enabled={enabled}"])
        trainer = RLTrainer(arm_cfg, copy.deepcopy(start), env)
        t0 = time.perf_counter()
        hist = [trainer.train_step() for _ in range(a.steps)]
        rates = [m["invalid_call_rate"] for m in hist]
        rewards = [m["reward"] for m in hist]
        result[arm] = {
            "steps_to_threshold": steps_to_threshold(rates, a.threshold),
            "final_reward": statistics.fmean(rewards[-10:]),
            "final_invalid_call_rate": statistics.fmean(rates[-10:]),
            "initial_invalid_call_rate": rates[0],
            "invalid_call_rate": rates,
            "reward": rewards,
            "hint_spans": [m["hint_spans"] for m in hist],
            "train_s": time.perf_counter() - t0,
        }
    base_steps = result["rl_only"]["steps_to_threshold"]
    fb_steps = result["rl_feedback"]["steps_to_threshold"]
    if base_steps is not None and fb_steps is not None:
        ratio = base_steps / max(fb_steps, 1)
    elif fb_steps is not None:
        ratio = None  # RL only never got there within the run: at least steps / fb_steps
    else:
        ratio = None
    result["speedup_steps_to_threshold"] = ratio
    png = Path(a.png)
    reward_png = png.with_name(png.stem + "_reward" + png.suffix)
    title = f"{a.policy} policy, {a.tasks}x{a.group} episodes/step"
    line_plot_png(
        png,
        {arm: result[arm]["invalid_call_rate"] for arm in ("rl_only", "rl_feedback")},
        title=f"invalid-call rate per step ({title})",
    )
    line_plot_png(
        reward_png,
        {arm: result[arm]["reward"] for arm in ("rl_only", "rl_feedback")},
        title=f"mean reward per step ({title})",
    )
    result["plot"] = [str(png), str(reward_png)]

    def fmt(s):
        return "never" if s is None else str(s)

    print(
        f"toy tool-use task, {a.policy} policy, {a.tasks}x{a.group} episodes/step, "
        f"{a.steps} steps, lr {a.lr}, kl coef {a.kl_coef}, teacher {a.teacher}"
    )
    print(
        f"{'arm':<14}{'steps<' + str(a.threshold):>12}{'final reward':>14}"
        f"{'invalid@0':>11}{'invalid@end':>13}"
    )
    for arm in ("rl_only", "rl_feedback"):
        r = result[arm]
        print(
            f"{arm:<14}{fmt(r['steps_to_threshold']):>12}{r['final_reward']:>14.3f}"
            f"{r['initial_invalid_call_rate']:>11.3f}{r['final_invalid_call_rate']:>13.4f}"
        )
    if ratio is not None:
        print(f"steps to threshold, rl_only / rl_feedback (baseline: RL only): {ratio:.1f}x")
    elif fb_steps is not None:
        print(
            f"RL only never stayed below {a.threshold} in {a.steps} steps; with feedback: "
            f"{fb_steps} steps (ratio > {a.steps / max(fb_steps, 1):.1f}x)"
        )
    else:
        print("neither arm stayed below the threshold")
    print(f"plots: {png} (invalid-call rate), {reward_png} (reward)")
    return result
