"""MoE pieces against plain-PyTorch references: grouped matmul, routing, bias balancing."""

from __future__ import annotations

import torch

from cadenza.config.model import ModelConfig
from cadenza.model.moe import MoE, grouped_linear, route


def test_grouped_linear_paths_match_per_group_matmuls():
    counts = torch.tensor([3, 0, 5, 1])
    for dim_in, dim_out in ((16, 8), (10, 6)):  # aligned (grouped_mm) and unaligned (bmm)
        x = torch.randn(int(counts.sum()), dim_in, requires_grad=True)
        w = torch.randn(4, dim_out, dim_in, requires_grad=True)
        y = grouped_linear(x, w, counts)
        rows = torch.repeat_interleave(torch.arange(4), counts)
        ref = torch.stack([x[r] @ w[g].T for r, g in enumerate(rows.tolist())])
        torch.testing.assert_close(y, ref)
        g = torch.randn_like(y)
        (gx, gw) = torch.autograd.grad(y, (x, w), g)
        (rx, rw) = torch.autograd.grad(ref, (x, w), g)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gw, rw)


def test_route_matches_a_per_token_reference():
    torch.manual_seed(0)
    N, E, G, keep, k = 50, 12, 4, 2, 3
    logits = torch.randn(N, E)
    bias = torch.randn(E) * 0.1
    w, idx = route(logits, bias, k, G, keep, True, 2.0)
    s = logits.sigmoid()
    for t in range(N):
        c = s[t] + bias
        group_score = c.view(G, -1).sort(descending=True).values[:, :2].sum(-1)
        groups = set(group_score.argsort(descending=True)[:keep].tolist())
        allowed = [e for e in range(E) if e // (E // G) in groups]
        chosen = sorted(allowed, key=lambda e: -c[e].item())[:k]
        assert sorted(idx[t].tolist()) == sorted(chosen)
        ref = s[t, idx[t]] / s[t, idx[t]].sum() * 2.0
        torch.testing.assert_close(w[t], ref)


def test_bias_update_is_sign_of_load_imbalance_and_counts_reset():
    cfg = ModelConfig(
        hidden_size=16,
        moe_intermediate_size=8,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        bias_update_speed=0.01,
    )
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    moe.train()
    x = torch.randn(3, 7, 16)
    moe(x)
    assert moe.tokens_per_expert.sum() == 3 * 7 * 2  # every token routed to k experts
    _, idx = moe.router(x.reshape(-1, 16))
    load = torch.bincount(idx.flatten(), minlength=4).float()
    torch.testing.assert_close(moe.tokens_per_expert, load)
    moe.update_router_bias()
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.router.e_score_correction_bias, expected)
    assert moe.tokens_per_expert.sum() == 0
    moe.eval()
    moe(x)
    assert moe.tokens_per_expert.sum() == 0  # only training forwards count
