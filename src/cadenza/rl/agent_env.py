"""RL environment over a task store: the agent harness runs the policy being trained.

Each step picks tasks from a store built by `cadenza tasks build` (round robin from a
resumable position, or seeded sampling), runs G episodes per task with `EpisodeRunner` and
`LocalPolicy` on the policy model itself (the cadenza sampler, one batch per turn over the
live episodes of all the step's groups), in the sandbox with the task's environment, and
grades each final workspace with the task factory's grader:

    reward = resolved                               (rl.reward=resolved)
           | passed / (|FAIL_TO_PASS| + |PASS_TO_PASS|)   (pass_fraction)
           | passed FAIL_TO_PASS / |FAIL_TO_PASS|   (fail_to_pass_fraction)

Episodes come back as the harness records them (token ids, policy mask, behavior logprobs,
turns with error kinds), so the feedback providers read their error kinds and a hint is
rendered as a whole user message at the boundary before its target turn with the agent's
chat format (`insert_message_before`), the same tokens a user message there would have.

Behavior logprobs: the objective scores softmax(logits / T) (rl/objective.py), so at a
temperature T != 1 the sampler's tempered logprobs are recorded instead of its T = 1 ones.
top_p is always 1 here: a nucleus-truncated distribution is not one the trainer can score.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadenza.agent.chat_format import ChatFormat, insert_message_before
from cadenza.agent.episode import Episode
from cadenza.agent.policies import LocalPolicy
from cadenza.agent.runner import AgentTask, EpisodeRunner
from cadenza.agent.task_source import load_task_store
from cadenza.agent.tools import TOOLS, Toolbox
from cadenza.config.agent import AgentConfig
from cadenza.rl.feedback import FeedbackContext

TASK_ORDERS = ("round_robin", "random")
REWARDS = ("resolved", "pass_fraction", "fail_to_pass_fraction")


def pick_tasks(
    n_tasks: int, n: int, position: int, order: str, rng: random.Random
) -> tuple[list[int], int]:
    """Indices of the next `n` tasks and the new position.

    round_robin: tasks position, position + 1, ... (mod n_tasks); the position is the number
    of tasks handed out so far, checkpointed with the trainer. random: uniform draws from
    `rng` (the trainer's task stream, whose state is checkpointed); the position still counts.
    """
    if n_tasks < 1:
        raise ValueError("the task store has no tasks; build some with `cadenza tasks build`")
    if order == "round_robin":
        return [(position + k) % n_tasks for k in range(n)], position + n
    if order == "random":
        return [rng.randrange(n_tasks) for _ in range(n)], position + n
    raise ValueError(f"task order: expected one of {list(TASK_ORDERS)}, found {order!r}")


def reward_of(details: dict[str, Any], kind: str, n_fail_to_pass: int) -> float:
    """The scalar reward of a grading report (cadenza.tasks.grade.score's fields)."""
    if kind == "resolved":
        return float(bool(details.get("resolved")))
    if kind == "pass_fraction":
        return float(details.get("pass_fraction", 0.0))
    if kind == "fail_to_pass_fraction":
        return details.get("fail_to_pass_passed", 0) / n_fail_to_pass if n_fail_to_pass else 0.0
    raise ValueError(f"rl.reward: expected one of {list(REWARDS)}, found {kind!r}")


def tempered_logprobs(generate_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`generate_fn` whose Generation.logprobs are those of the distribution sampled from
    (softmax(logits / T)) when T != 1; at T = 1 the sampler's log_softmax values are kept."""

    def generate(model, prompts, max_new_tokens, temperature, top_p, stop_tokens, seed):
        gens = generate_fn(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_tokens=stop_tokens,
            seed=seed,
        )
        if temperature != 1.0:
            for g in gens:
                if len(g.sampling_logprobs) == len(g.tokens):
                    g.logprobs = list(g.sampling_logprobs)
        return gens

    return generate


def select_tools(names: Sequence[str]) -> Toolbox:
    """The agent's toolbox restricted to `names` (all tools when empty)."""
    if not names:
        return Toolbox()
    known = {t.name for t in TOOLS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"rl.tools: unknown tools {unknown}; the agent's tools are {sorted(known)}"
        )
    if "submit" not in names:
        raise ValueError(
            f"rl.tools={list(names)} lacks submit: an episode could only end by its limits; "
            "add submit"
        )
    return Toolbox([t for t in TOOLS if t.name in set(names)])


class AgentEnv:
    """`rl.rollout.Environment` over a task store, with the agent harness as the actor."""

    name = "agent"

    def __init__(
        self,
        tasks_dir: str | Path,
        fmt: ChatFormat,
        agent: AgentConfig | None = None,
        *,
        temperature: float = 1.0,
        order: str = "round_robin",
        reward: str = "resolved",
        tools: Sequence[str] = (),
        instance_ids: list[str] | None = None,
        grade_timeout: float = 600.0,
        generate_fn: Callable[..., Any] | None = None,
        run_command: Callable[..., Any] | None = None,
        workdir: str | Path | None = None,
    ):
        from cadenza.tasks.store import read_tasks

        if temperature <= 0:
            raise ValueError(
                f"rl.temperature: expected > 0 for RL (greedy decoding has no behavior "
                f"distribution to score), found {temperature}"
            )
        if order not in TASK_ORDERS:
            raise ValueError(f"rl.task_order: expected one of {list(TASK_ORDERS)}, found {order!r}")
        if reward not in REWARDS:
            raise ValueError(f"rl.reward: expected one of {list(REWARDS)}, found {reward!r}")
        tasks_dir = Path(tasks_dir)
        if not (tasks_dir / "tasks.jsonl").is_file():
            raise ValueError(
                f"rl.tasks_dir={str(tasks_dir)!r} has no tasks.jsonl; build a task store with "
                "`cadenza tasks build SOURCE --out DIR` and point rl.tasks_dir at DIR"
            )
        self.fmt = fmt
        self.agent = replace(agent or AgentConfig(), temperature=temperature, top_p=1.0)
        self.temperature, self.order, self.reward = temperature, order, reward
        self.toolbox = select_tools(tools)
        self.tasks: list[AgentTask] = load_task_store(tasks_dir, instance_ids, grade_timeout)
        self.rows = {r["instance_id"]: r for r in read_tasks(tasks_dir)}
        self.generate_fn = generate_fn
        self.run_command = run_command
        self.workdir = Path(workdir) if workdir is not None else None
        self.position = 0

    # -- tasks ----------------------------------------------------------------------------
    def sample_tasks(self, n: int, rng: random.Random) -> list[AgentTask]:
        idx, self.position = pick_tasks(len(self.tasks), n, self.position, self.order, rng)
        return [self.tasks[i] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state.get("position", 0))

    # -- rollouts -------------------------------------------------------------------------
    def policy(self, model: nn.Module, seed: int) -> LocalPolicy:
        if self.generate_fn is None:
            from cadenza.model import generate as generate_fn
        else:
            generate_fn = self.generate_fn
        return LocalPolicy(
            model,
            self.fmt,
            temperature=self.temperature,
            top_p=1.0,
            seed=seed,
            generate_fn=tempered_logprobs(generate_fn),
        )

    def rollout(
        self, model: nn.Module, tasks: list[AgentTask], group_size: int, gen: torch.Generator
    ) -> list[list[Episode]]:
        """[len(tasks)][group_size] graded episodes; sampling seeded from `gen`.

        Workspaces live in a temporary directory removed afterwards (an episode's
        info["model_patch"] keeps what it changed)."""
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        runner = EpisodeRunner(
            self.policy(model, seed), self.fmt, self.agent, self.toolbox, self.run_command
        )
        if self.workdir is not None:
            self.workdir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="cadenza-rollout-", dir=self.workdir))
        try:
            dirs = [root / f"g{k}" for k in range(len(tasks))]  # a task may come twice
            groups = runner.run_groups(tasks, group_size, dirs)
            for task, episodes in zip(tasks, groups):
                for ep in episodes:
                    self._set_reward(ep, task)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return groups

    def _set_reward(self, ep: Episode, task: AgentTask) -> None:
        details = ep.info.get("grade")
        if not isinstance(details, dict):  # grader failed (info["grade_error"]): no reward
            ep.reward, ep.resolved = 0.0, False
            return
        n_f2p = len(self.rows[task.instance_id].get("FAIL_TO_PASS", []))
        ep.reward = reward_of(details, self.reward, n_f2p)

    # -- feedback -------------------------------------------------------------------------
    def feedback_context(self, task: AgentTask) -> FeedbackContext:
        """The offered tools' argument schemas; the task's gold patch for the leak filter."""
        tools = {t.name: dict(t.parameters) for t in self.toolbox.tools.values()}
        row = self.rows.get(task.instance_id, {})
        return FeedbackContext(tools=tools, hidden_patch=row.get("patch", ""))

    def render_hint(self, text: str, episode: Episode, turn_index: int) -> list[int]:
        """The hint as a whole user message at the boundary before `turn_index`, tokenized
        by the chat format exactly as `insert_message_before` inserts it."""
        message = {"role": "user", "content": text}
        try:
            ids, _ = insert_message_before(episode, turn_index, "user", text, self.fmt)
        except (IndexError, ValueError):
            # not an assistant turn: the teacher counts the span as bad_turn (no crash)
            return self.fmt.message_ids(message)
        start = episode.turns[turn_index].start
        return ids[start : start + len(ids) - len(episode.token_ids)]
