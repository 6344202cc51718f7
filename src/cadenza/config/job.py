"""The main job's config: one dataclass per concern, composed; presets `tiny` and `k2`.

`load_config("tiny", ["train.steps=50"])` or `load_config("my.yaml", [...])`: a YAML file
may name a preset to start from with a top-level `preset:` key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cadenza.config.agent import AgentConfig
from cadenza.config.base import ConfigError, from_dict, load_yaml, merge, parse_overrides, to_dict
from cadenza.config.model import ModelConfig, k2_model, tiny_model
from cadenza.config.optim import OptimConfig
from cadenza.config.parallel import ParallelConfig
from cadenza.config.rl import RLConfig
from cadenza.config.sandbox import SandboxConfig
from cadenza.config.tasks import TasksConfig


@dataclass
class DataConfig:
    """Pretraining corpus: Python source files (default: this machine's standard library)."""

    corpus: str = "stdlib"  # "stdlib" or a directory of source files
    max_files: int = 400
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.02


@dataclass
class TokenizerConfig:
    path: str | None = None  # an existing tokenizer.json; None: train one
    vocab_size: int = 4096
    max_train_bytes: int = 8_000_000


@dataclass
class TrainConfig:
    mode: str = "pretrain"  # "pretrain" until the RL trainer lands
    steps: int = 300
    seed: int = 0
    out_dir: str = "runs/tiny"
    log_every: int = 10
    eval_every: int = 100
    ckpt_every: int = 100
    threads: int = 0  # torch intra-op threads; 0 = the cores this process may use
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_batches: int = 4
    keep_checkpoints: int = 2  # newest checkpoints kept; 0 keeps all
    sample_prompt: str = "def fibonacci(n):"
    sample_tokens: int = 48
    resume: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rl: RLConfig = field(default_factory=RLConfig)


def tiny() -> Config:
    return Config(model=tiny_model())


def k2() -> Config:
    return Config(
        model=k2_model(),
        tokenizer=TokenizerConfig(vocab_size=163840),
        data=DataConfig(seq_len=4096, batch_size=1),
        train=TrainConfig(out_dir="runs/k2"),
        optim=OptimConfig(qk_clip=True),
    )


PRESETS = {"tiny": tiny, "k2": k2}


def load_config(source: str | None = None, overrides: list[str] | None = None) -> Config:
    """Build the job config from a preset name or a YAML file, then `key=value` overrides."""
    source = source or "tiny"
    if source in PRESETS:
        base = PRESETS[source]()
        data: dict = {}
    elif Path(source).suffix in (".yaml", ".yml") or Path(source).exists():
        data = load_yaml(source)
        preset = data.pop("preset", "tiny")
        if preset not in PRESETS:
            raise ConfigError(
                f"{source}: unknown preset {preset!r}; expected one of {sorted(PRESETS)}"
            )
        base = PRESETS[preset]()
    else:
        raise ConfigError(
            f"--config {source!r}: expected a preset ({', '.join(sorted(PRESETS))}) or a YAML file path"
        )
    merged = merge(merge(to_dict(base), data), parse_overrides(overrides or []))
    return from_dict(Config, merged)
