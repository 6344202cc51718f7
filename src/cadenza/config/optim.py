"""Optimizer config: Muon over the model's natural units, AdamW over the rest, lr schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class OptimConfig:
    # "muon": Muon on unit-declared matrices + AdamW on the rest; "adamw": AdamW on everything
    # (the baseline for Muon-vs-AdamW comparisons).
    optimizer: Literal["muon", "adamw"] = "muon"
    # Muon. With adjust_lr="match_rms_adamw" (Moonshot) the update RMS matches AdamW's, so
    # Muon can share AdamW's lr and weight decay; "original" (Keller Jordan) wants lr ~ 0.02.
    lr: float = 3e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    ns_steps: int = 5
    ns_coefficients: Literal["quintic", "polar_express"] = "quintic"
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # AdamW on embeddings, lm_head, norms, router, biases (weight decay only on >= 2-D ones).
    adamw_lr: float = 3e-3
    adamw_weight_decay: float = 0.1
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.95
    adamw_eps: float = 1e-8
    # Schedule: linear warmup, then cosine to min_lr_ratio, or WSD (constant, then a linear
    # decay over the last decay_fraction of the steps), or constant.
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    # MuonClip (Kimi K2): after each step, rescale q/k weights of heads whose max attention
    # logit exceeded qk_clip_tau.
    qk_clip: bool = False
    qk_clip_tau: float = 100.0
    # A NaN/inf gradient: "error" stops with the parameter names, "skip" skips the step and counts it.
    nonfinite: Literal["error", "skip"] = "error"
    # Sharded Muon (parameters sharded by cadenza.parallel): elements per all-to-all bucket;
    # extra memory is about 3x this per bucket in flight (two in flight).
    bucket_numel: int = 1 << 22

    def __post_init__(self) -> None:
        problems = []
        for name in ("lr", "adamw_lr", "weight_decay", "adamw_weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.momentum < 1:
            problems.append(f"momentum={self.momentum} must be in [0, 1)")
        if not 0 <= self.ns_steps < 100:
            problems.append(f"ns_steps={self.ns_steps} must be in [0, 100)")
        for name in ("adamw_beta1", "adamw_beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps={self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0 <= self.decay_fraction <= 1:
            problems.append(f"decay_fraction={self.decay_fraction} must be in [0, 1]")
        if self.qk_clip_tau <= 0:
            problems.append(f"qk_clip_tau={self.qk_clip_tau} must be > 0")
        if problems:
            raise ValueError("invalid optim config: " + "; ".join(problems))
