"""Hinted teacher: index map, teacher rows vs direct forwards, bad input, empty-hint self-test."""

import pytest
import torch
from torch import nn

from cadenza.agent.episode import Episode, Turn
from cadenza.rl.feedback import Hint
from cadenza.rl.feedback_loss import empty_hint_self_test, hint_loss
from cadenza.rl.teacher import (
    SpanError,
    Teacher,
    TeacherStats,
    build_teacher_input,
    teacher_logits,
)

V = 13


class TinyLM(nn.Module):
    """A causal LM small enough for exact checks: embedding -> GRU -> head."""

    def __init__(self, vocab=V, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0])


def _episode():
    # system [0,3), user [3,5), assistant [5,9) with header 5 and end 8 not sampled,
    # tool [9,11), assistant [11,14)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 6, 12, 9]
    mask = [False] * 14
    for i in (6, 7, 12, 13):
        mask[i] = True
    turns = [
        Turn("system", 0, 3),
        Turn("user", 3, 5),
        Turn("assistant", 5, 9),
        Turn("tool", 9, 11),
        Turn("assistant", 11, 14),
    ]
    return Episode("t", ids, mask, [0.0] * 14, turns)


def test_index_map_and_mask():
    ep = _episode()
    t = build_teacher_input(ep, 2, [11, 12, 10])
    assert t.ids == [1, 2, 3, 4, 5, 11, 12, 10, 6, 7, 8, 9]
    assert t.target_positions == [6, 7]  # header and end-of-turn tokens are not targets
    assert t.student_rows == [5, 6] and t.teacher_rows == [8, 9]
    for i, r in zip(t.target_positions, t.teacher_rows):
        assert t.ids[r + 1] == ep.token_ids[i]  # teacher row r predicts the student's token


def test_teacher_rows_equal_direct_forwards_of_the_hinted_context():
    torch.manual_seed(0)
    model = TinyLM()
    ep = _episode()
    hint = [11, 12, 10]
    inputs = [build_teacher_input(ep, 2, hint), build_teacher_input(ep, 4, hint)]
    got = teacher_logits(model, inputs)
    for t, rows in zip(inputs, got):
        for j, i in enumerate(t.target_positions):
            s = t.insert_at
            ctx = ep.token_ids[:s] + hint + ep.token_ids[s:i]  # oracle: the context before y_i
            want = model(torch.tensor([ctx]))[0, -1]
            torch.testing.assert_close(rows[j], want, rtol=1e-5, atol=1e-6)


def test_prefix_scorer_is_used_when_the_model_offers_it():
    torch.manual_seed(0)
    base = TinyLM()
    calls = []

    class Cached(TinyLM):
        def score_with_prefix(self, prefix, suffixes, rows):
            calls.append(len(prefix))
            return [
                self(torch.tensor([prefix + s]))[0, [len(prefix) + r for r in rs]]
                for s, rs in zip(suffixes, rows)
            ]

    cached = Cached()
    cached.load_state_dict(base.state_dict())
    ep = _episode()
    inputs = [build_teacher_input(ep, 2, [11]), build_teacher_input(ep, 4, [12, 12])]
    want = teacher_logits(base, inputs)
    got = teacher_logits(cached, inputs)
    assert calls == [5]  # shared prefix = tokens before the first hinted turn
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_bad_spans_are_counted_never_raised():
    ep = _episode()
    with pytest.raises(SpanError) as e:
        build_teacher_input(ep, 9, [1])
    assert e.value.reason == "bad_turn"
    model = TinyLM()
    logits = model(torch.tensor([ep.token_ids]))[0]
    stats = TeacherStats()
    hints = [Hint(9, "x", "a"), Hint(3, "x", "a"), Hint(2, "x", "a"), Hint(4, "x", "b")]
    kl, n = hint_loss(logits, ep, hints, [[1], [1], [1] * 30, [1]], model, stats, max_len=20)
    assert stats.skipped == {"bad_turn": 2, "too_long": 1}
    assert n == 2 and stats.hinted_by_provider == {"b": 1}

    class Broken(TinyLM):
        def forward(self, ids):
            raise RuntimeError("out of memory")

    stats = TeacherStats()
    kl, n = hint_loss(logits, ep, [Hint(2, "x", "a")], [[1]], Broken(), stats)
    assert n == 0 and kl.item() == 0.0 and stats.skipped == {"forward_error": 1}


@pytest.mark.parametrize("estimator", ["reverse_kl", "topk_jsd", "sampled"])
def test_empty_hint_gives_exactly_zero_kl_and_gradient(estimator):
    torch.manual_seed(0)
    out = empty_hint_self_test(TinyLM(), _episode(), estimator)
    assert out == {"kl": 0.0, "grad": 0.0}


def test_kl_gradient_moves_student_toward_teacher_preferred_token():
    torch.manual_seed(0)
    model = TinyLM()
    ep = _episode()
    hint = [11, 12, 10]
    frozen = Teacher(model, "frozen")
    with torch.no_grad():
        frozen.model.head.bias[3] += 4.0  # the teacher clearly prefers token 3
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def p3():
        with torch.no_grad():
            return model(torch.tensor([ep.token_ids]))[0, [5, 6]].softmax(-1)[:, 3]

    before, kls = p3(), []
    for _ in range(10):
        opt.zero_grad()
        logits = model(torch.tensor([ep.token_ids]))[0]
        stats = TeacherStats()
        kl, n = hint_loss(logits, ep, [Hint(2, "h", "p")], [hint], frozen.model, stats)
        (kl / n).backward()
        opt.step()
        kls.append(stats.spans[0]["kl"])
        if len(kls) == 1:
            assert torch.all(p3() > before)  # one step already raises it at both positions
    assert torch.all(p3() > before + 0.2)
    assert kls[-1] < 0.5 * kls[0]


def test_ema_teacher_update():
    torch.manual_seed(0)
    model = TinyLM()
    teacher = Teacher(model, "ema", ema_decay=0.75)
    w0 = teacher.model.head.weight.clone()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    teacher.update()
    torch.testing.assert_close(teacher.model.head.weight, w0 + 0.25)
    assert Teacher(model, "current").model is model
    with pytest.raises(ValueError, match="teacher mode"):
        Teacher(model, "bogus")


def _small_causal_lm():
    from cadenza.config.model import ModelConfig
    from cadenza.model import CausalLM

    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return CausalLM(cfg)


def test_causal_lm_shared_prefix_cache_matches_direct_forwards():
    model = _small_causal_lm()
    ep = _episode()
    hint = [11, 12, 10]
    inputs = [build_teacher_input(ep, 2, hint), build_teacher_input(ep, 4, [12])]
    got = teacher_logits(model, inputs)  # prefill once + score both suffixes
    for t, rows in zip(inputs, got):
        for j, i in enumerate(t.target_positions):
            s = t.insert_at
            ctx = ep.token_ids[:s] + (hint if s == 5 else [12]) + ep.token_ids[s:i]
            want = model(torch.tensor([ctx]))[0, -1]
            torch.testing.assert_close(rows[j], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("estimator", ["reverse_kl", "sampled"])
def test_causal_lm_empty_hint_self_test(estimator):
    assert empty_hint_self_test(_small_causal_lm(), _episode(), estimator) == {
        "kl": 0.0,
        "grad": 0.0,
    }


def test_span_ends_at_first_teacher_divergent_token():
    from cadenza.rl.feedback_loss import first_divergence, span_loss
    from cadenza.rl.kl import reverse_kl

    lp = torch.tensor([-0.1, -0.2, -0.1])
    assert first_divergence(lp, torch.tensor([-0.5, -3.0, -9.0]), 1.0) == 1
    assert first_divergence(lp, lp, 1.0) is None
    ep = _episode()  # turn 2: sampled tokens at 6 (id 7) and 7 (id 8)
    t_in = build_teacher_input(ep, 2, [11])
    student = torch.zeros(14, V, requires_grad=True)
    q = torch.zeros(2, V)
    q[0, 7] = -5.0  # the teacher rejects the student's first token ...
    q[1, 2] = 9.0  # ... and, conditioned on it, predicts garbage next
    stats = TeacherStats()
    s, n = span_loss(student, ep, Hint(2, "h", "p"), t_in, q, stats, divergence_margin=1.0)
    assert n == 1  # the second token is not distilled
    assert s.item() == pytest.approx(reverse_kl(student[5:6], q[:1]).item(), rel=1e-6)
    s_all, n_all = span_loss(student, ep, Hint(2, "h", "p"), t_in, q, TeacherStats())
    assert n_all == 2
