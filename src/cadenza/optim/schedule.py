"""Learning-rate schedules as pure functions of the step: lr(step) = base_lr * lr_factor(step).

warmup (step < W):  (step + 1) / W
cosine:             m + (1 - m) (1 + cos(pi p)) / 2,   p = (step - W) / (total - W) in [0, 1]
wsd:                1 until the last `decay_fraction` of the steps, then linear to m
                    (warmup-stable-decay: the stable phase can be extended without a restart)
constant:           1
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["cosine", "wsd", "constant"]


def lr_factor(
    step: int,
    total_steps: int,
    schedule: Schedule = "cosine",
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        p = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * total_steps))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        p = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1 - min_lr_ratio) * p
    raise ValueError(f"lr schedule: expected 'cosine', 'wsd' or 'constant', found {schedule!r}")
