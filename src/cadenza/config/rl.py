"""RL config: GRPO-family objective, text feedback, rollouts (train.mode=rl)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FeedbackConfig:
    """Targeted text feedback: hints per turn, a hinted teacher, a KL term on that turn."""

    enabled: bool = True
    providers: list[str] = field(
        default_factory=lambda: ["unknown_tool", "invalid_arguments", "repeated_failure"]
    )
    kl_coef: float = 1.0  # lambda in L_RL / N_RL + lambda * L_KL / N_hint
    estimator: str = "reverse_kl"  # "reverse_kl" | "topk_jsd" | "sampled"
    topk: int = 16  # for topk_jsd
    margin: float = 0.0  # keep spans whose teacher gain (mean log p - log q) >= margin; 0: all
    # end each span at the first token the teacher finds divergence_margin nats less likely
    truncate_at_divergence: bool = True
    divergence_margin: float = 1.0
    teacher: str = "current"  # "current" | "ema" | "frozen"
    ema_decay: float = 0.99
    max_message_chars: int = 4000
    judge_url: str = ""  # OpenAI-compatible base URL for the llm_judge provider
    judge_model: str = ""

    def __post_init__(self) -> None:
        _check("rl.feedback.estimator", self.estimator, ("reverse_kl", "topk_jsd", "sampled"))
        _check("rl.feedback.teacher", self.teacher, ("current", "ema", "frozen"))
        if "llm_judge" in self.providers and not (self.judge_url and self.judge_model):
            raise ValueError(
                "rl.feedback.providers has llm_judge but judge_url/judge_model are empty; "
                "set rl.feedback.judge_url=http://host:port/v1 and rl.feedback.judge_model=NAME"
            )


@dataclass
class RLConfig:
    env: str = "toy"  # "toy" (synthetic tool-use task) | "agent" (agent harness on tasks_dir)
    policy: str = "gru"  # toy env: "gru" (ToyPolicy) | "causal_lm" (a micro cadenza CausalLM)
    group_size: int = 8  # G episodes per task
    tasks_per_step: int = 8
    normalize_std: bool = True  # False: Dr.GRPO advantages
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: str = "token-mean"  # "token-mean" | "seq-mean" | "constant"
    max_tokens: int = 0  # normalizer for aggregation="constant"
    ref_kl_coef: float = 0.0  # k3 KL to the initial policy; 0 disables the reference copy
    optimizer: str = "adamw"  # "adamw" | "muon" (cadenza.optim.build_optimizer)
    lr: float = 3e-3
    grad_clip: float = 1.0
    temperature: float = 1.0
    max_context: int = 2048  # hinted teacher sequences longer than this are skipped
    warmup_steps: int = 300  # toy env: supervised warm-up of the fresh policy before RL
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    # env=agent (rl/agent_env.py): tasks from a store built by `cadenza tasks build`
    tasks_dir: str = ""
    task_order: str = "round_robin"  # "round_robin" (resumable position) | "random" (seeded)
    reward: str = "resolved"  # "resolved" | "pass_fraction" | "fail_to_pass_fraction"
    # the policy: a checkpoint dir (config.json, *.safetensors, tokenizer.json), else a fresh
    # model.* with tokenizer.path
    init_from: str = ""
    tools: list[str] = field(default_factory=list)  # agent tools offered; empty: all

    def __post_init__(self) -> None:
        _check("rl.env", self.env, ("toy", "agent"))
        _check("rl.task_order", self.task_order, ("round_robin", "random"))
        _check("rl.reward", self.reward, ("resolved", "pass_fraction", "fail_to_pass_fraction"))
        if self.env == "agent" and not self.tasks_dir:
            raise ValueError(
                "rl.env=agent needs rl.tasks_dir=DIR, a task store built by "
                "`cadenza tasks build SOURCE --out DIR`"
            )
        _check("rl.policy", self.policy, ("gru", "causal_lm"))
        _check("rl.optimizer", self.optimizer, ("adamw", "muon"))
        _check("rl.aggregation", self.aggregation, ("token-mean", "seq-mean", "constant"))
        if self.aggregation == "constant" and self.max_tokens <= 0:
            raise ValueError("rl.aggregation=constant (Dr.GRPO) needs rl.max_tokens > 0")
        if self.group_size < 2:
            raise ValueError(
                f"rl.group_size: expected >= 2 (advantages are relative within a group), "
                f"found {self.group_size}"
            )


def _check(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: expected one of {list(allowed)}, found {value!r}")
