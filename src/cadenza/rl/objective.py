"""One RL step's objective over groups of graded episodes, with optional text feedback.

    L = L_RL / N_RL + lambda * L_KL / N_hint

L_RL is the clipped GRPO surrogate over the sampled tokens of episodes in informative
groups (dynamic sampling); L_KL sums the hinted-turn divergences of every episode that got a
hint, whatever its group's rewards (a group where every episode made the same bad call still
gets a local signal). Both come from ONE student forward per episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cadenza.agent.episode import Episode
from cadenza.config.rl import RLConfig
from cadenza.rl.advantages import group_advantages, informative_groups
from cadenza.rl.feedback import Hint
from cadenza.rl.feedback_loss import prepare_spans, span_loss
from cadenza.rl.kl import combine
from cadenza.rl.policy_loss import policy_loss, token_weights
from cadenza.rl.teacher import (
    TeacherStats,
    batched_teacher_logits,
    logits_of,
    prefix_scorer,
    teacher_logits,
)


@dataclass
class Batch:
    ids: Tensor  # [B, T] padded token ids
    mask: Tensor  # [B, T] policy tokens of episodes that carry an RL signal
    behavior: Tensor  # [B, T]
    advantages: Tensor  # [B]
    lengths: list[int]


def collate(episodes: list[Episode], advantages: list[float], rl_on: list[bool], pad: int = 0):
    width = max(len(e.token_ids) for e in episodes)
    b = len(episodes)
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.bool)
    behavior = torch.zeros((b, width))
    for k, e in enumerate(episodes):
        n = len(e.token_ids)
        ids[k, :n] = torch.tensor(e.token_ids)
        if rl_on[k]:
            mask[k, :n] = torch.tensor(e.policy_mask)
        behavior[k, :n] = torch.tensor(e.behavior_logprobs)
    mask[:, 0] = False  # nothing predicts the first token
    return Batch(
        ids, mask, behavior, torch.tensor(advantages), [len(e.token_ids) for e in episodes]
    )


def token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """logp[b, i] = log softmax(logits[b, i - 1])[ids[b, i]]; column 0 is 0."""
    lp = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return F.pad(lp, (1, 0))


@dataclass
class StepOutput:
    loss: Tensor
    metrics: dict = field(default_factory=dict)


def rl_objective(
    model: nn.Module,
    groups: list[list[Episode]],
    cfg: RLConfig,
    hints: dict[tuple[int, int], list[tuple[Hint, list[int]]]] | None = None,
    teacher_model: nn.Module | None = None,
    ref_model: nn.Module | None = None,
) -> StepOutput:
    """Loss and metrics for groups [num_groups][G]; hints keyed by (group, index)."""
    hints = hints or {}
    rewards = torch.tensor([[e.reward for e in g] for g in groups], dtype=torch.float32)
    adv = group_advantages(rewards, normalize_std=cfg.normalize_std)
    keep = (
        informative_groups(rewards)
        if cfg.dynamic_sampling
        else torch.ones(len(groups), dtype=torch.bool)
    )
    chosen, advs, rl_on, keys = [], [], [], []
    for gi, g in enumerate(groups):
        for ei, e in enumerate(g):
            if keep[gi] or (gi, ei) in hints:
                chosen.append(e)
                advs.append(float(adv[gi, ei]))
                rl_on.append(bool(keep[gi]))
                keys.append((gi, ei))
    stats = TeacherStats()
    metrics = {
        "reward_mean": float(rewards.mean()),
        "groups_kept": int(keep.sum()),
        "groups_total": len(groups),
    }
    if not chosen:
        zero = sum(p.sum() * 0.0 for p in model.parameters())
        metrics.update(rl_tokens=0, **stats.summary())
        return StepOutput(zero, metrics)
    batch = collate(chosen, advs, rl_on)
    logits = logits_of(model, batch.ids)
    # the sampler's behavior logprobs are of the tempered distribution; score the same one
    logprobs = token_logprobs(logits / cfg.temperature, batch.ids)
    ref_lp = None
    if ref_model is not None and cfg.ref_kl_coef > 0:
        with torch.no_grad():
            ref_logits = logits_of(ref_model, batch.ids) / cfg.temperature
            ref_lp = token_logprobs(ref_logits, batch.ids)
    n_rl = int(batch.mask.sum())
    weights = token_weights(batch.mask, cfg.aggregation, cfg.max_tokens or None)
    pl = policy_loss(
        logprobs,
        batch.behavior,
        batch.advantages,
        batch.mask,
        cfg.eps_low,
        cfg.eps_high,
        ref_logprobs=ref_lp,
        kl_coef=cfg.ref_kl_coef,
        weights=weights,
    )
    kl_sum, n_hint = logits.sum() * 0.0, 0
    fb = cfg.feedback
    teacher = teacher_model if teacher_model is not None else model
    spans = []  # (row in batch, hint, teacher input) over the whole step
    for k, key in enumerate(keys):
        pairs = hints.get(key)
        if pairs:
            found = prepare_spans(
                chosen[k], [h for h, _ in pairs], [i for _, i in pairs], stats, cfg.max_context
            )
            spans.extend((k, h, t) for h, t in found)
    if spans:
        # Episodes with several hinted turns share their prefix's KV cache (when the model
        # offers prefix scoring); single spans go into one batched forward.
        per_episode: dict[int, list[int]] = {}
        for j, (k, _, _) in enumerate(spans):
            per_episode.setdefault(k, []).append(j)
        shared = prefix_scorer(teacher) is not None
        qs: list = [None] * len(spans)
        single = [j for js in per_episode.values() if len(js) == 1 or not shared for j in js]
        for j, q in zip(single, batched_teacher_logits(teacher, [spans[j][2] for j in single])):
            qs[j] = q
        for js in per_episode.values():
            if shared and len(js) > 1:
                for j, q in zip(js, teacher_logits(teacher, [spans[j][2] for j in js])):
                    qs[j] = q
        for (k, hint, t_in), q in zip(spans, qs):
            s, n = span_loss(
                logits[k],
                chosen[k],
                hint,
                t_in,
                q,
                stats,
                fb.estimator,
                fb.topk,
                fb.margin,
                fb.divergence_margin if fb.truncate_at_divergence else None,
            )
            if s is not None:
                kl_sum, n_hint = kl_sum + s, n_hint + n
    loss = combine(pl.loss, kl_sum, n_hint, fb.kl_coef)
    metrics.update(
        rl_loss=float(pl.loss.detach()),
        rl_tokens=n_rl,
        clip_fraction=pl.clip_fraction,
        ratio_mean=pl.ratio_mean,
        ref_kl=pl.kl_ref,
        loss=float(loss.detach()),
        **stats.summary(),
    )
    return StepOutput(loss, metrics)


INVALID_CALL_KINDS = ("unknown_tool", "invalid_arguments", "malformed_call")


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Rollout metrics: mean reward, share of episodes with an invalid tool call, length."""
    n = max(len(episodes), 1)
    invalid = sum(
        any(k in INVALID_CALL_KINDS for t in e.turns for k in t.error_kinds) for e in episodes
    )
    return {
        "reward": sum(e.reward for e in episodes) / n,
        "invalid_call_rate": invalid / n,
        "episode_tokens": sum(len(e.token_ids) for e in episodes) / n,
    }
