"""RL loss terms against values computed by hand on small tensors."""

import math

import pytest
import torch

from cadenza.rl.advantages import group_advantages, informative_groups
from cadenza.rl.kl import combine, reverse_kl, sampled_token_kl, span_divergence, topk_tail_jsd
from cadenza.rl.policy_loss import k3_kl, policy_loss, token_weights


def test_group_advantages_grpo_and_dr_grpo():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    a = group_advantages(r, normalize_std=True)
    # mean 0.5, population std 0.5 -> +-1; an all-equal group -> 0
    torch.testing.assert_close(a[0], torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-5, rtol=0)
    assert torch.equal(a[1], torch.zeros(4))
    d = group_advantages(r, normalize_std=False)
    torch.testing.assert_close(d[0], torch.tensor([-0.5, 0.5, 0.5, -0.5]))
    assert informative_groups(r).tolist() == [True, False]
    with pytest.raises(ValueError, match="num_groups, G"):
        group_advantages(torch.zeros(4))


def _case():
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.7, 9.0]])
    behavior = torch.full((2, 3), -1.0)
    logprobs = (behavior + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = torch.tensor([1.0, -1.0])
    return logprobs, behavior, mask, adv


def test_policy_loss_clipping_and_aggregations():
    logprobs, behavior, mask, adv = _case()
    # per-token l: seq0 (A=+1): -1.28 (clipped at 1+0.28), -0.5 (0.5 < 0.8: unclipped), masked
    #              seq1 (A=-1): 1.1, 0.8 (clipped at 1-0.2), 9.0 (no upper clip for A<0)
    kw = dict(eps_low=0.2, eps_high=0.28)
    out = policy_loss(logprobs, behavior, adv, mask, aggregation="token-mean", **kw)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8 + 9.0) / 5, rel=1e-5)
    assert out.clip_fraction == pytest.approx(2 / 5)
    out.loss.backward()
    # d l / d logp = -A r where the unclipped term is active, 0 where clipped; / 5 tokens
    expected = torch.tensor([[0.0, -0.5, 0.0], [1.1, 0.0, 9.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-5, atol=1e-6)
    seq = policy_loss(logprobs, behavior, adv, mask, aggregation="seq-mean", **kw)
    assert seq.loss.item() == pytest.approx(
        ((-1.28 - 0.5) / 2 + (1.1 + 0.8 + 9.0) / 3) / 2, rel=1e-5
    )
    const = policy_loss(logprobs, behavior, adv, mask, aggregation="constant", max_tokens=4, **kw)
    assert const.loss.item() == pytest.approx(9.12 / 8, rel=1e-5)
    with pytest.raises(ValueError, match="max_tokens"):
        token_weights(mask, "constant")


def test_masked_tokens_get_no_gradient():
    logprobs, behavior, mask, adv = _case()
    logprobs.data[0, 2] = 50.0  # a huge ratio on a tool/system token must not matter
    out = policy_loss(logprobs, behavior, adv, mask)
    out.loss.backward()
    assert logprobs.grad[0, 2].item() == 0.0
    assert math.isfinite(out.loss.item())


def test_k3_reference_kl():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert k3_kl(lp, ref).item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    logprobs, behavior, mask, adv = _case()
    base = policy_loss(logprobs, behavior, adv, mask).loss.item()
    ref_lp = logprobs.detach() + math.log(0.5)  # k3 = 0.5 + ln2 - 1 on every token
    with_kl = policy_loss(logprobs, behavior, adv, mask, ref_logprobs=ref_lp, kl_coef=0.1)
    assert with_kl.loss.item() == pytest.approx(base + 0.1 * (0.5 + math.log(2) - 1), rel=1e-5)
    assert with_kl.kl_ref == pytest.approx(0.5 + math.log(2) - 1, rel=1e-5)


def test_reverse_kl_value_and_gradient_direction():
    student = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)  # p = [.25, .75]
    teacher = torch.tensor([[0.0, 0.0]])  # q = [.5, .5]: prefers token 0 relative to p
    kl = reverse_kl(student, teacher)
    assert kl.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-6)
    kl.sum().backward()
    p = torch.tensor([0.25, 0.75])
    q = torch.tensor([0.5, 0.5])
    expected = p * ((p / q).log() - kl.item())  # d D / d z_j = p_j (log p_j/q_j - D)
    torch.testing.assert_close(student.grad[0], expected, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        stepped = student - 1.0 * student.grad
    assert stepped.softmax(-1)[0, 0] > 0.25  # the teacher-preferred token moved up


def test_topk_tail_jsd_by_hand():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    got = topk_tail_jsd(p.log(), q.log(), k=2).item()
    # teacher top-2 = tokens 3, 2; buckets p~ = [.1, .2, .7], q~ = [.4, .3, .3], m = [.25, .25, .5]
    want = 0.5 * (0.1 * math.log(0.4) + 0.2 * math.log(0.8) + 0.7 * math.log(1.4)) + 0.5 * (
        0.4 * math.log(1.6) + 0.3 * math.log(1.2) + 0.3 * math.log(0.6)
    )
    assert got == pytest.approx(want, rel=1e-5)
    full = topk_tail_jsd(p.log(), q.log(), k=4).item()  # empty tail: plain JSD
    m = (p + q) / 2
    want_full = 0.5 * ((p * (p / m).log()).sum() + (q * (q / m).log()).sum()).item()
    assert full == pytest.approx(want_full, rel=1e-5)
    assert topk_tail_jsd(p.log(), p.log(), k=2).item() == 0.0


def test_sampled_token_estimator_is_unbiased_for_the_kl_gradient():
    torch.manual_seed(0)
    z = torch.randn(5, requires_grad=True)
    t = torch.randn(5)
    (g_true,) = torch.autograd.grad(reverse_kl(z[None], t[None]).sum(), z)
    p = z.softmax(-1).detach()
    logq = t.log_softmax(-1)
    g = torch.zeros(5)
    for y in range(5):  # exact expectation over y ~ p
        lp = z.log_softmax(-1)[y]
        surrogate, est = sampled_token_kl(lp[None], logq[y][None])
        (gy,) = torch.autograd.grad(surrogate.sum(), z)
        g += p[y] * gy
        assert est.item() == pytest.approx((lp - logq[y]).item(), rel=1e-6)
    torch.testing.assert_close(g, g_true, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("estimator", ["reverse_kl", "topk_jsd", "sampled"])
def test_identical_teacher_gives_exactly_zero(estimator):
    z = torch.randn(3, 7, requires_grad=True)
    loss, est = span_divergence(estimator, z, z.detach().clone(), torch.tensor([1, 4, 6]), topk=3)
    loss.sum().backward()
    assert torch.all(est == 0)
    assert torch.all(z.grad == 0)


def test_combine_uses_separate_normalizers():
    total = combine(torch.tensor(1.0), torch.tensor(3.0), n_hint=2, kl_coef=0.5)
    assert total.item() == pytest.approx(1.75)
    assert combine(torch.tensor(1.0), torch.tensor(0.0), n_hint=0, kl_coef=0.5).item() == 1.0
