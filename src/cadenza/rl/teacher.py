"""The hinted teacher: episode tokens with a hint inserted before a target turn.

For a target assistant turn occupying tokens [s, e) of the episode and hint tokens h (a
whole rendered message, |h| = H), the teacher sequence is

    x_teacher = x[:s] + h + x[s:e]

and the student's target position i (s <= i < e, a token the policy sampled) sits at
i + H in it. Logits predicting token i come from the position before it, so the student row
is i - 1 and the teacher row is i - 1 + H. The teacher runs without gradient on the student's
own sampled tokens; the prefix x[:s] is the same for both and, for a model that exposes a
prefix cache (`score_with_prefix`), is computed once per episode and shared by all hinted
turns of that episode. Without such an API the teacher is one forward per hinted turn.

Teachers: "current" (the policy itself under no_grad), "ema" (an exponential moving average
of the policy: theta_T <- beta theta_T + (1 - beta) theta), "frozen" (a copy taken at start).

Failures are data, not crashes: a hint that does not fit the context budget, a target turn
out of range, a teacher forward that raises are each counted in `TeacherStats.skipped` and the
span is left out of the loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from cadenza.agent.episode import Episode

TEACHER_MODES = ("current", "ema", "frozen")


@dataclass
class TeacherInput:
    """One hinted span ready for the teacher forward."""

    ids: list[int]  # x[:s] + h + x[s:e]
    insert_at: int  # s
    hint_len: int  # H
    target_positions: list[int]  # student positions i of sampled tokens in [s, e)

    @property
    def student_rows(self) -> list[int]:
        return [i - 1 for i in self.target_positions]

    @property
    def teacher_rows(self) -> list[int]:
        return [i - 1 + self.hint_len for i in self.target_positions]


class SpanError(ValueError):
    """A hinted span that cannot be used; `reason` is the counter key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def build_teacher_input(
    episode: Episode, turn_index: int, hint_ids: list[int], max_len: int | None = None
) -> TeacherInput:
    """The teacher sequence and index map for one hinted turn, or SpanError(reason)."""
    n_turns = len(episode.turns)
    if not 0 <= turn_index < n_turns:
        raise SpanError(
            "bad_turn", f"target turn {turn_index} out of range: episode has {n_turns} turns"
        )
    turn = episode.turns[turn_index]
    if turn.role != "assistant":
        raise SpanError("bad_turn", f"target turn {turn_index} is a {turn.role} turn")
    s, e = turn.start, turn.end
    if not 0 < s <= e <= len(episode.token_ids):
        raise SpanError(
            "bad_turn",
            f"turn {turn_index} span [{s}, {e}) outside the episode's "
            f"{len(episode.token_ids)} tokens (a turn needs at least one token before it)",
        )
    targets = [i for i in range(s, e) if episode.policy_mask[i]]
    if not targets:
        raise SpanError("empty_span", f"turn {turn_index} has no sampled tokens")
    ids = episode.token_ids[:s] + list(hint_ids) + episode.token_ids[s:e]
    if max_len is not None and len(ids) > max_len:
        raise SpanError(
            "too_long",
            f"hinted sequence of {len(ids)} tokens exceeds the context budget {max_len} "
            f"(hint {len(hint_ids)} tokens)",
        )
    return TeacherInput(ids, s, len(hint_ids), targets)


def logits_of(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Teacher forwards must not count router load or take training-only branches."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def batched_teacher_logits(model: nn.Module, inputs: list[TeacherInput], chunk: int = 64):
    """Teacher logits [n_targets, V] per input, right-padded into batches of `chunk`.

    Right padding is invisible to a causal model at the positions we read. A chunk whose
    forward raises yields None for each of its inputs (the caller counts them)."""
    device = next(model.parameters()).device
    out: list[Tensor | None] = []
    with eval_mode(model):
        for c in range(0, len(inputs), chunk):
            part = inputs[c : c + chunk]
            width = max(len(t.ids) for t in part)
            ids = torch.zeros((len(part), width), dtype=torch.long, device=device)
            for k, t in enumerate(part):
                ids[k, : len(t.ids)] = torch.tensor(t.ids, device=device)
            try:
                logits = logits_of(model, ids)
            except Exception:  # counted by the caller as forward_error
                out.extend([None] * len(part))
                continue
            out.extend(logits[k, t.teacher_rows] for k, t in enumerate(part))
    return out


def _causal_lm_scores(model: nn.Module, prefix: list[int], suffixes, rows) -> list[Tensor]:
    """cadenza.model's prefill/score: the prefix's KV cache is computed once and shared by
    every suffix (hint + turn); `rows` are relative to the prefix end."""
    from cadenza.model import prefill, score

    with eval_mode(model):
        pre = prefill(model, [prefix]).repeat(len(suffixes))
        # Scores.logits[b, i] predicts suffix token i, i.e. comes from position prefix + i - 1
        sc = score(model, pre, [list(s) for s in suffixes])
    return [sc.logits[b, [r + 1 for r in rs]] for b, rs in enumerate(rows)]


def prefix_scorer(model: nn.Module):
    """The model's shared-prefix scoring function, or None: a `score_with_prefix(prefix,
    suffixes, rows)` method, or cadenza.model's prefill/score for a CausalLM."""
    fn = getattr(model, "score_with_prefix", None)
    if fn is not None:
        return fn
    from cadenza.model import CausalLM

    if isinstance(model, CausalLM):
        return lambda prefix, suffixes, rows: _causal_lm_scores(model, prefix, suffixes, rows)
    return None


@torch.no_grad()
def teacher_logits(model: nn.Module, inputs: list[TeacherInput]) -> list[Tensor | None]:
    """Teacher logits [n_targets, V] for each hinted span of ONE episode (None: failed).

    With several spans and a prefix scorer (`prefix_scorer`), the prefix before the first
    hinted turn is computed once for all of them; otherwise batched full forwards (these give
    bit-identical logits to the student's forward on the same tokens, which the empty-hint
    self-test relies on).
    """
    if not inputs:
        return []
    scorer = prefix_scorer(model)
    if scorer is not None and len(inputs) > 1:
        shared = min(t.insert_at for t in inputs)
        prefix = inputs[0].ids[:shared]
        suffixes = [t.ids[shared:] for t in inputs]
        rows = [[r - shared for r in t.teacher_rows] for t in inputs]
        try:
            return list(scorer(prefix, suffixes, rows))
        except Exception:
            return [None] * len(inputs)
    return batched_teacher_logits(model, inputs)


class Teacher:
    """Which weights score the hinted context: the policy itself, an EMA, or a frozen copy."""

    def __init__(self, policy: nn.Module, mode: str = "current", ema_decay: float = 0.99):
        if mode not in TEACHER_MODES:
            raise ValueError(f"teacher mode: expected one of {TEACHER_MODES}, found {mode!r}")
        self.mode = mode
        self.ema_decay = ema_decay
        self.policy = policy
        self.copy = None if mode == "current" else copy.deepcopy(policy).requires_grad_(False)

    @property
    def model(self) -> nn.Module:
        return self.policy if self.copy is None else self.copy

    @torch.no_grad()
    def update(self) -> None:
        """After each optimizer step: theta_T <- beta theta_T + (1 - beta) theta (EMA only)."""
        if self.mode != "ema":
            return
        for t, p in zip(self.copy.parameters(), self.policy.parameters()):
            t.lerp_(p.detach(), 1.0 - self.ema_decay)

    def state_dict(self) -> dict:
        return {} if self.copy is None else self.copy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.copy is not None and state:
            self.copy.load_state_dict(state)


@dataclass
class TeacherStats:
    """Diagnostics of the text-feedback loss for one step."""

    skipped: Counter = field(default_factory=Counter)  # reason -> spans left out
    hinted_by_provider: Counter = field(default_factory=Counter)  # provider -> spans used
    spans: list[dict] = field(default_factory=list)  # per span: provider, turn, tokens, kl, gain

    def _kl_by_provider(self) -> dict[str, float]:
        sums: dict[str, list[float]] = {}
        for s in self.spans:
            for p in s["provider"].split("+"):
                sums.setdefault(p, []).append(s["kl"])
        return {p: sum(v) / len(v) for p, v in sums.items()}

    def summary(self) -> dict:
        n = len(self.spans)
        return {
            "hint_spans": n,
            "hint_tokens": sum(s["tokens"] for s in self.spans),
            "hint_kl_mean": sum(s["kl"] for s in self.spans) / n if n else 0.0,
            "teacher_gain_mean": sum(s["gain"] for s in self.spans) / n if n else 0.0,
            "hinted_by_provider": dict(self.hinted_by_provider),
            "hint_kl_by_provider": self._kl_by_provider(),
            "hint_skipped": dict(self.skipped),
        }
