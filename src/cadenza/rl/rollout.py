"""What the RL trainer needs from an environment: tasks, graded groups, feedback context.

An environment samples tasks, runs G episodes per task with the current policy (recording
token ids, policy masks and behavior logprobs, see agent/episode.py), grades them (sets
`Episode.reward`), and tells the feedback providers what they may know (available tools,
the hidden patch for the answer-leak filter). `render_hint` turns a hint's text into the
tokens of a whole message inserted at the boundary before the target turn, in the
environment's chat format.

An environment with a position of its own (which task comes next) also offers
`state_dict()` / `load_state_dict(state)`; the trainer checkpoints it.

Implementations: `rl.toy_env.ToyEnv` (synthetic tool-use task, seconds on a CPU) and
`rl.agent_env.AgentEnv` (the agent harness on a task store, graded by the task factory).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import torch
from torch import nn

from cadenza.agent.episode import Episode
from cadenza.rl.feedback import FeedbackContext


class Environment(Protocol):
    name: str

    def sample_tasks(self, n: int, rng: random.Random) -> list[Any]: ...

    def rollout(
        self, model: nn.Module, tasks: list[Any], group_size: int, gen: torch.Generator
    ) -> list[list[Episode]]:
        """[len(tasks)][group_size] graded episodes, sampled with `gen` (deterministic)."""
        ...

    def feedback_context(self, task: Any) -> FeedbackContext: ...

    def render_hint(self, text: str, episode: Episode, turn_index: int) -> list[int]: ...
