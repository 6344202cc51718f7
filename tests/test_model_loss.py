"""Fused linear cross-entropy against F.cross_entropy on materialized logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadenza.config.model import ModelConfig
from cadenza.model import CausalLM
from cadenza.model.loss import linear_cross_entropy


@pytest.mark.parametrize("chunk_bytes", [2**26, 4 * 37 * 5])  # one chunk; chunks of 5 rows
def test_value_and_gradients_match_cross_entropy(chunk_bytes):
    N, D, V = 23, 12, 37
    h = torch.randn(N, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    y = torch.randint(0, V, (N,))
    y[[2, 9, 10]] = -100
    got = linear_cross_entropy(h, w, y, chunk_bytes=chunk_bytes)
    gh, gw = torch.autograd.grad(got * 3.0, (h, w))
    ref = F.cross_entropy(h @ w.T, y, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref * 3.0, (h, w))
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


def test_model_loss_matches_logits_path():
    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=True,
    )
    model = CausalLM(cfg)
    ids = torch.randint(0, 50, (3, 9))
    got = model.loss(ids)
    got.backward()
    g_fused = model.embed.weight.grad.clone()
    model.zero_grad()
    ref = F.cross_entropy(model(ids)[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    ref.backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g_fused, model.embed.weight.grad)
