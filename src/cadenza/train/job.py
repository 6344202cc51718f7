"""`run_job(cfg)`: the main job behind `cadenza train`, chosen by cfg.train.mode."""

from __future__ import annotations

from cadenza.config import Config
from cadenza.train.pretrain import PretrainError, PretrainResult, pretrain

MODES = ("pretrain",)


def run_job(cfg: Config) -> PretrainResult:
    """Run the job `cfg` describes; stop signals raise cadenza.train.pretrain.Interrupted."""
    if cfg.train.mode == "pretrain":
        return pretrain(cfg)
    raise PretrainError(
        f"train.mode={cfg.train.mode!r}: expected one of {list(MODES)} "
        "(the RL trainer is not part of this build yet)"
    )
