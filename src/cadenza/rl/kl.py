"""Divergence estimators for the text-feedback loss on a target span.

p is the student (policy on the original context), q the teacher (the same model, or an
EMA/frozen copy, with the hint in its context). Logits are [N, V] for the N target tokens of
a span, aligned so row i of both predicts the student's own sampled token y_i. The teacher is
always detached: gradients flow into the student only.

- `reverse_kl`: D(p || q) = sum_v p_v (log p_v - log q_v), full vocabulary. Gradient w.r.t.
  the student logit z_j is p_j (log p_j - log q_j - D), which raises the student's logits
  where the teacher puts relatively more mass.
- `topk_tail_jsd`: Jensen-Shannon divergence over the teacher's top-k tokens plus one tail
  bucket holding the remaining mass of each distribution, so only k + 1 numbers per position
  of the teacher need to be kept: JSD = 1/2 KL(p~ || m) + 1/2 KL(q~ || m), m = (p~ + q~) / 2.
- `sampled_token_kl`: the single-sample estimate d_i = log p(y_i) - log q(y_i) with y_i ~ p,
  used as a per-token advantage. The surrogate is l_i = stopgrad(d_i) * log p(y_i), whose
  gradient stopgrad(d_i) * grad log p(y_i) is, in expectation over y_i ~ p, exactly
  grad D(p || q) (the score-function identity, using E_p[grad log p] = 0). It costs one
  logprob per token instead of a vocabulary-wide sum; its value is not the KL, so the
  diagnostics report mean d_i instead. Caveat: unbiasedness needs y_i ~ p unconditionally.
  Spans chosen BECAUSE the sampled turn was wrong (an unknown tool) only ever push the
  sampled token down, and the freed mass can flow to tokens nobody sampled yet: in the toy
  ablation (bench/feedback.py) this estimator drove the invalid-call rate to ~100%, while
  the full-vocabulary reverse KL, which also pulls the teacher's preferred tokens up,
  converged. Prefer `reverse_kl` (or `topk_jsd`) for error-targeted hints.

The combined objective keeps separate normalizers so a short hinted span is not drowned by a
long trajectory: L = L_RL / N_RL + lambda * L_KL / N_hint (see `combine`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ESTIMATORS = ("reverse_kl", "topk_jsd", "sampled")


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Per-position D(p || q) over the full vocabulary, [N].

    The gradient is applied in closed form, g_j = p_j (delta_j - D) with
    delta = log p - log q, through a surrogate that is linear in the logits and has value D.
    Autograd through p (log p - log q) would leave a rounding residue of sum_v p_v grad
    log p_v (zero in exact arithmetic) when teacher and student agree; the closed form is
    exactly zero there, which the empty-hint self-test relies on.
    """
    z = student_logits.float()
    logp = F.log_softmax(z.detach(), dim=-1)
    logq = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    p = logp.exp()
    delta = logp - logq
    d = (p * delta).sum(dim=-1)
    g = p * (delta - d[:, None])
    return d + (g * (z - z.detach())).sum(dim=-1)


def _tail_bucketed(logprobs: Tensor, idx: Tensor) -> Tensor:
    """Probabilities [N, k+1]: the k entries at `idx`, then the remaining mass."""
    top = logprobs.gather(-1, idx).exp()
    tail = (1.0 - top.sum(dim=-1, keepdim=True)).clamp(min=0.0)
    return torch.cat([top, tail], dim=-1)


def topk_tail_jsd(student_logits: Tensor, teacher_logits: Tensor, k: int = 16) -> Tensor:
    """Per-position JSD over the teacher's top-k tokens plus a tail bucket, [N]."""
    k = min(k, student_logits.shape[-1])
    logp = F.log_softmax(student_logits.float(), dim=-1)
    logq = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    idx = logq.topk(k, dim=-1).indices
    p = _tail_bucketed(logp, idx)
    q = _tail_bucketed(logq, idx)
    m = 0.5 * (p + q)
    # xlogy: 0 * log 0 = 0, so an empty tail bucket contributes nothing.
    kl_pm = (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(dim=-1)
    kl_qm = (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(dim=-1)
    return 0.5 * (kl_pm + kl_qm)


def sampled_token_kl(student_logprobs: Tensor, teacher_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """(surrogate [N], estimate [N]) from the logprobs of the sampled tokens y_i.

    surrogate_i = stopgrad(log p(y_i) - log q(y_i)) * log p(y_i): minimize its sum.
    estimate_i = log p(y_i) - log q(y_i) (detached): the KL diagnostic.
    """
    d = (student_logprobs - teacher_logprobs).detach()
    return d * student_logprobs, d


def span_divergence(
    estimator: str,
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor,
    topk: int = 16,
) -> tuple[Tensor, Tensor]:
    """(loss terms [N] to sum and minimize, divergence estimates [N] for diagnostics)."""
    if estimator == "reverse_kl":
        d = reverse_kl(student_logits, teacher_logits)
        return d, d.detach()
    if estimator == "topk_jsd":
        d = topk_tail_jsd(student_logits, teacher_logits, topk)
        return d, d.detach()
    if estimator == "sampled":
        lp = F.log_softmax(student_logits.float(), -1).gather(-1, targets[:, None])[:, 0]
        lq = F.log_softmax(teacher_logits.detach().float(), -1).gather(-1, targets[:, None])[:, 0]
        return sampled_token_kl(lp, lq)
    raise ValueError(f"kl estimator: expected one of {ESTIMATORS}, found {estimator!r}")


def combine(rl_loss: Tensor, kl_sum: Tensor, n_hint: int, kl_coef: float) -> Tensor:
    """L = L_RL / N_RL + lambda * L_KL / N_hint; `rl_loss` arrives already divided by N_RL."""
    if n_hint <= 0:
        return rl_loss + 0.0 * kl_sum
    return rl_loss + kl_coef * kl_sum / n_hint
