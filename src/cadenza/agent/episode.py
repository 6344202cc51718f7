"""Episodes as recorded by the agent harness and consumed by grading, monitoring and RL.

An episode is one token sequence (the whole multi-turn conversation as the policy saw it)
plus, per message, its token span and what happened in it. Token-level arrays are aligned
with `token_ids`: `policy_mask[i]` is True where the policy sampled token i (assistant turns'
generated tokens, never system/user/tool tokens or template scaffolding the harness added),
and `behavior_logprobs[i]` is the sampler's logprob of token i there (0.0 elsewhere).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | None  # None when the arguments could not be parsed
    raw: str  # the call's text as generated
    id: str = ""


@dataclass
class Turn:
    """One message of the conversation and its span [start, end) in the episode's tokens."""

    role: str  # "system" | "user" | "assistant" | "tool"
    start: int
    end: int
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # Per-turn error kinds, e.g. "unknown_tool", "invalid_arguments", "malformed_call",
    # "truncated"; text feedback targets turns by these.
    error_kinds: list[str] = field(default_factory=list)
    observation: str | None = None  # for tool turns: what the tool returned
    tool_name: str | None = None  # for tool turns: which tool answered


@dataclass
class Episode:
    task_id: str
    token_ids: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    resolved: bool = False
    finish_reason: str = ""  # "submit" | "max_turns" | "max_tokens" | "context" | "error"
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.policy_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"episode {self.task_id}: token arrays disagree in length "
                f"(token_ids={n}, policy_mask={len(self.policy_mask)}, "
                f"behavior_logprobs={len(self.behavior_logprobs)})"
            )

    def assistant_turns(self) -> list[int]:
        return [i for i, t in enumerate(self.turns) if t.role == "assistant"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        d = dict(d)
        turns = []
        for t in d.pop("turns", []):
            t = dict(t)
            t["tool_calls"] = [ToolCall(**c) for c in t.get("tool_calls", [])]
            turns.append(Turn(**t))
        return cls(turns=turns, **d)
