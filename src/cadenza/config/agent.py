"""Agent harness config: episode limits, sampling, tool timeouts, the system prompt."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a repository. Use the tools to read, edit and test "
    "the code, then call submit. Each reply must contain at least one tool call."
)


@dataclass
class AgentConfig:
    max_turns: int = 30  # assistant turns per episode
    max_new_tokens: int = 512  # per assistant turn
    max_episode_tokens: int = 8192  # tokens sampled over a whole episode
    max_context: int = 16384  # the episode's whole token sequence
    temperature: float = 1.0
    top_p: float = 1.0
    command_timeout: float = 60.0  # `run` tool, seconds
    test_timeout: float = 300.0  # `run_tests` tool, seconds
    memory_mb: int | None = 2048  # per sandboxed command
    max_observation_chars: int = 8000
    tool_workers: int = 4  # episodes of a group whose tools and grading run concurrently
    unsafe_sandbox: bool = False  # allow commands without bubblewrap (says so loudly)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_episode_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, found {getattr(self, name)}")
