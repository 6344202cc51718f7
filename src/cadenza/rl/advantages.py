"""Group-relative advantages (GRPO, Dr.GRPO) and dynamic sampling.

Rewards come as a [num_groups, G] tensor: G episodes sampled for the same task.

    A_ij = r_ij - mean_j(r_i.)                      (Dr.GRPO: no std, no length bias)
    A_ij = (r_ij - mean_j(r_i.)) / (std_j(r_i.) + eps)   (GRPO)

`std` is the population standard deviation (correction 0) of the group, so a group of
two rewards {0, 1} gets advantages {-1, +1} (up to eps).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages [num_groups, G] from rewards [num_groups, G]."""
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards: expected shape [num_groups, G], found {tuple(rewards.shape)}; "
            "reshape flat rewards with .view(num_groups, G)"
        )
    rewards = rewards.to(torch.float32)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    std = rewards.std(dim=1, keepdim=True, correction=0)
    return centered / (std + eps)


def informative_groups(rewards: Tensor, atol: float = 0.0) -> Tensor:
    """Dynamic sampling: bool [num_groups], False where all G rewards are equal.

    Such groups have zero advantage everywhere, so they add no policy gradient but still
    count in the token normalizer; dropping them keeps the effective batch informative.
    """
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return spread > atol
