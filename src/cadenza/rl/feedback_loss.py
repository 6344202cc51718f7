"""The text-feedback KL term of one episode: hints -> teacher spans -> divergence sum.

    L_KL(episode) = sum over hinted turns k, sum over sampled tokens i of turn k of
                    D(p(. | x_<i) || q(. | x_<s_k, h_k, x_[s_k, i)))

returned as (sum, token count) so the trainer divides by N_hint over the whole batch
(rl/kl.py `combine`). Spans are filtered: the teacher must prefer a different behavior by
`margin` (mean log p(y) - log q(y) over the span, `feedback.teacher_prefers_other`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cadenza.agent.episode import Episode
from cadenza.rl.feedback import Hint, teacher_prefers_other
from cadenza.rl.kl import span_divergence
from cadenza.rl.teacher import (
    SpanError,
    TeacherInput,
    TeacherStats,
    build_teacher_input,
    eval_mode,
    logits_of,
    teacher_logits,
)


def prepare_spans(
    episode: Episode,
    hints: list[Hint],
    hint_ids: list[list[int]],
    stats: TeacherStats,
    max_len: int | None = None,
) -> list[tuple[Hint, TeacherInput]]:
    """Teacher inputs for the usable hints; the others are counted in `stats.skipped`."""
    out = []
    for hint, ids in zip(hints, hint_ids):
        try:
            out.append((hint, build_teacher_input(episode, hint.turn_index, ids, max_len)))
        except SpanError as e:
            stats.skipped[e.reason] += 1
    return out


def first_divergence(lp: Tensor, lq: Tensor, margin: float) -> int | None:
    """Index of the first token with log p(y) - log q(y) > margin, or None."""
    hits = ((lp - lq) > margin).nonzero()
    return int(hits[0, 0]) if len(hits) else None


def span_loss(
    student_logits: Tensor,
    episode: Episode,
    hint: Hint,
    t_in: TeacherInput,
    q: Tensor | None,
    stats: TeacherStats,
    estimator: str = "reverse_kl",
    topk: int = 16,
    margin: float = 0.0,
    divergence_margin: float | None = None,
) -> tuple[Tensor | None, int]:
    """(sum of divergence terms, tokens) of one hinted span; (None, 0) if filtered/failed.

    With `divergence_margin`, the span ends at the first token the teacher finds much less
    likely than the student (log p(y_i) - log q(y_i) > margin): past that token the student
    has committed to something the hinted teacher would not have done, so the teacher's
    predictions are conditioned on a prefix it would never produce and are no target (in the
    toy ablation, distilling them taught the policy to write a tool name as the argument).
    """
    if q is None:
        stats.skipped["forward_error"] += 1
        return None, 0
    p = student_logits[t_in.student_rows]
    y = torch.tensor([episode.token_ids[i] for i in t_in.target_positions], device=p.device)
    with torch.no_grad():
        lp = F.log_softmax(p.float(), -1).gather(-1, y[:, None])[:, 0]
        lq = F.log_softmax(q.float(), -1).gather(-1, y[:, None])[:, 0]
    if divergence_margin is not None:
        cut = first_divergence(lp, lq, divergence_margin)
        if cut is not None:
            p, q, y, lp, lq = p[: cut + 1], q[: cut + 1], y[: cut + 1], lp[: cut + 1], lq[: cut + 1]
    keep, gain = teacher_prefers_other(lp.tolist(), lq.tolist(), margin)
    if not keep and margin > 0:
        stats.skipped["no_margin"] += 1
        return None, 0
    terms, est = span_divergence(estimator, p, q, y, topk)
    stats.hinted_by_provider.update(hint.provider.split("+"))
    stats.spans.append(
        {
            "provider": hint.provider,
            "turn": hint.turn_index,
            "tokens": len(y),
            "kl": float(est.mean()),
            "gain": gain,
        }
    )
    return terms.sum(), len(y)


def hint_loss(
    student_logits: Tensor,
    episode: Episode,
    hints: list[Hint],
    hint_ids: list[list[int]],
    teacher_model: nn.Module,
    stats: TeacherStats,
    estimator: str = "reverse_kl",
    topk: int = 16,
    margin: float = 0.0,
    max_len: int | None = None,
    divergence_margin: float | None = None,
) -> tuple[Tensor, int]:
    """(sum of per-token divergence terms, number of hinted tokens) for one episode.

    `student_logits` [T, V] come from the policy's forward on the episode's own tokens (the
    same forward as the RL term). Nothing here raises for a bad span: it is counted in
    `stats.skipped` and left out.
    """
    total, n_tokens = student_logits.sum() * 0.0, 0
    spans = prepare_spans(episode, hints, hint_ids, stats, max_len)
    qs = teacher_logits(teacher_model, [t for _, t in spans])
    for (hint, t_in), q in zip(spans, qs):
        s, n = span_loss(
            student_logits,
            episode,
            hint,
            t_in,
            q,
            stats,
            estimator,
            topk,
            margin,
            divergence_margin,
        )
        if s is not None:
            total, n_tokens = total + s, n_tokens + n
    return total, n_tokens


def empty_hint_self_test(
    model: nn.Module, episode: Episode, estimator: str = "reverse_kl"
) -> dict[str, float]:
    """With an empty hint the teacher IS the student: KL and gradient must be exactly zero.

    Checks every assistant turn of `episode` through the same code path as training (index
    map, teacher forward, estimator). Returns {"kl": max |KL|, "grad": max |gradient|}.
    """
    with eval_mode(model):
        return _self_test(model, episode, estimator)


def _self_test(model: nn.Module, episode: Episode, estimator: str) -> dict[str, float]:
    device = next(model.parameters()).device
    worst_kl, worst_grad = 0.0, 0.0
    for k in episode.assistant_turns():
        turn = episode.turns[k]
        ids = torch.tensor([episode.token_ids[: turn.end]], device=device)
        model.zero_grad(set_to_none=True)
        logits = logits_of(model, ids)[0]
        stats = TeacherStats()
        kl, n = hint_loss(
            logits, episode, [Hint(k, "", "self_test")], [[]], model, stats, estimator
        )
        if n == 0:
            continue
        kl.backward()
        kl = kl.detach()
        worst_kl = max(worst_kl, abs(kl.item()))
        for prm in model.parameters():
            if prm.grad is not None:
                worst_grad = max(worst_grad, float(prm.grad.abs().max()))
    model.zero_grad(set_to_none=True)
    return {"kl": worst_kl, "grad": worst_grad}
