"""`run_job(cfg)`: the main job behind `cadenza train`, chosen by cfg.train.mode."""

from __future__ import annotations

from cadenza.config import Config
from cadenza.train.pretrain import PretrainError, PretrainResult, pretrain

MODES = ("pretrain", "rl")


def run_job(cfg: Config) -> PretrainResult | object:
    """Run the job `cfg` describes; stop signals raise cadenza.train.pretrain.Interrupted."""
    if cfg.train.mode == "pretrain":
        return pretrain(cfg)
    if cfg.train.mode == "rl":
        from cadenza.train.rl_trainer import run_rl_job

        return run_rl_job(cfg)
    raise PretrainError(f"train.mode={cfg.train.mode!r}: expected one of {list(MODES)}")
