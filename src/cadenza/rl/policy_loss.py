"""Token-level clipped policy-gradient loss (PPO/GRPO family) with asymmetric clipping.

Per policy token t of sequence b, with ratio r = exp(logp - logp_behavior) and advantage A:

    l_bt = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  [+ beta * k3_bt]
    k3_bt = exp(logp_ref - logp) - (logp_ref - logp) - 1    (Schulman's k3, >= 0, unbiased KL)

Aggregation (what the sum of l_bt is divided by; `token_weights` returns the weights w_bt
so that the loss is sum_bt w_bt l_bt):

- "token-mean":    w = 1 / (total policy tokens in the batch)            (DAPO)
- "seq-mean":      w = 1 / (B * policy tokens of sequence b)            (GRPO original)
- "constant":      w = 1 / (B * max_tokens), max_tokens a fixed budget  (Dr.GRPO)

Only tokens where `mask` is True (tokens the policy sampled) contribute: system, user, tool
and template tokens carry no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean", "constant")


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) from the sampled token's logprobs."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def token_weights(
    mask: Tensor, aggregation: str = "token-mean", max_tokens: int | None = None
) -> Tensor:
    """Weights [B, T] (zero off-mask) such that the aggregated loss is sum(w * l)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, found {aggregation!r}")
    m = mask.to(torch.float32)
    if aggregation == "token-mean":
        return m / m.sum().clamp(min=1.0)
    if aggregation == "seq-mean":
        per_seq = m.sum(dim=1, keepdim=True).clamp(min=1.0)
        return m / (per_seq * m.shape[0])
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(
            f"aggregation='constant' (Dr.GRPO) needs max_tokens > 0, found {max_tokens!r}; "
            "set it to the generation budget per episode"
        )
    return m / float(m.shape[0] * max_tokens)


@dataclass
class PolicyLossOutput:
    loss: Tensor  # scalar, already aggregated
    per_token: Tensor  # [B, T] unweighted l_bt (zero off-mask)
    clip_fraction: float  # share of policy tokens where the clipped term was the active one
    ratio_mean: float
    kl_ref: float  # mean k3 over policy tokens (0 without a reference)


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: str = "token-mean",
    max_tokens: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    weights: Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate over [B, T] token logprobs; `advantages` is [B] or [B, T].

    `weights` overrides the aggregation (e.g. normalizers computed over a whole batch that
    is processed in micro-batches).
    """
    if logprobs.shape != behavior_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "policy_loss: logprobs, behavior_logprobs and mask must have the same [B, T] shape, "
            f"found {tuple(logprobs.shape)}, {tuple(behavior_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    maskf = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behavior_logprobs) * maskf  # zero off-mask: ratio 1, no overflow
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    per_token = -surrogate
    kl_val = 0.0
    if ref_logprobs is not None:
        k3 = k3_kl(logprobs, ref_logprobs) * maskf
        per_token = per_token + kl_coef * k3
        kl_val = float(k3.detach().sum() / maskf.sum().clamp(min=1.0))
    per_token = per_token * maskf
    w = weights if weights is not None else token_weights(mask, aggregation, max_tokens)
    loss = (per_token * w).sum()
    with torch.no_grad():
        n = maskf.sum().clamp(min=1.0)
        clip_frac = float(((clipped < unclipped).to(maskf.dtype) * maskf).sum() / n)
        ratio_mean = float((ratio * maskf).sum() / n)
    return PolicyLossOutput(loss, per_token, clip_frac, ratio_mean, kl_val)
