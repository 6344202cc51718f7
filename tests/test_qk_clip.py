"""MuonClip's QK-clip on the real MLA model: a head forced above tau is brought back to tau."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cadenza.config.model import tiny_model
from cadenza.config.optim import OptimConfig
from cadenza.model import CausalLM
from cadenza.optim.build import build_optimizer
from cadenza.optim.qk_clip import apply_qk_clip, enable_max_logit

torch.set_num_threads(1)
TAU = 100.0


def _model(q_lora_rank):
    cfg = dataclasses.replace(tiny_model(), num_hidden_layers=2, q_lora_rank=q_lora_rank)
    model = CausalLM(cfg)
    enable_max_logit(model)
    return model


def _max_logits(model, ids):
    with torch.no_grad():
        model(ids)
    return [layer.attn.max_logit.clone() for layer in model.layers]


def _force_head(model, layer, head, ids, target):
    """Scale one head's query rows so its max logit becomes `target` (> tau)."""
    attn = model.layers[layer].attn
    q = attn.q_b_proj.weight if attn.q_lora_rank is not None else attn.q_proj.weight
    before = _max_logits(model, ids)[layer][head]
    assert before > 0
    rows = slice(head * attn.qk_dim, (head + 1) * attn.qk_dim)
    with torch.no_grad():
        q[rows] *= target / before


@pytest.mark.parametrize("q_lora_rank", [64, None])
def test_forced_head_is_clipped_to_tau_others_unchanged(q_lora_rank):
    model = _model(q_lora_rank)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24))
    _force_head(model, layer=0, head=1, ids=ids, target=3 * TAU)
    before = _max_logits(model, ids)
    assert before[0][1] > TAU
    assert all(float(m.max()) < TAU for m in before[1:])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    stats = apply_qk_clip(model, TAU)
    assert stats.clipped_heads == 1 and stats.max_logit == pytest.approx(float(before[0][1]))

    after = _max_logits(model, ids)
    assert after[0][1] <= TAU * (1 + 1e-5)
    assert after[0][1] == pytest.approx(TAU, rel=1e-4)
    others = [h for h in range(before[0].shape[0]) if h != 1]
    torch.testing.assert_close(after[0][others], before[0][others], rtol=1e-6, atol=1e-6)

    attn = model.layers[0].attn
    q_name = "q_b_proj.weight" if q_lora_rank is not None else "q_proj.weight"
    gamma = TAU / float(before[0][1])
    nope, v, qk = attn.nope_dim, attn.v_dim, attn.qk_dim
    for name, p in model.named_parameters():
        old = params[name]
        if name == f"layers.0.attn.{q_name}":
            h = slice(qk, 2 * qk)
            q_old, q_new = old[h], p.detach()[h]
            torch.testing.assert_close(q_new[:nope], q_old[:nope] * gamma**0.5)
            torch.testing.assert_close(q_new[nope:], q_old[nope:] * gamma)
            mask = torch.ones(old.shape[0], dtype=torch.bool)
            mask[h] = False
            assert torch.equal(p.detach()[mask], old[mask])
        elif name == "layers.0.attn.kv_b_proj.weight":
            w = nope + v
            k_old, k_new = old[w : 2 * w], p.detach()[w : 2 * w]
            torch.testing.assert_close(k_new[:nope], k_old[:nope] * gamma**0.5)
            assert torch.equal(k_new[nope:], k_old[nope:])  # values untouched
            assert torch.equal(p.detach()[:w], old[:w]) and torch.equal(
                p.detach()[2 * w :], old[2 * w :]
            )
        else:  # includes the shared rope key in kv_a_proj_with_mqa
            assert torch.equal(p.detach(), old), name


def test_build_optimizer_applies_qk_clip_after_the_step():
    model = _model(64)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24))
    _force_head(model, layer=1, head=0, ids=ids, target=2 * TAU)
    cfg = OptimConfig(lr=0.0, adamw_lr=0.0, qk_clip=True, qk_clip_tau=TAU, warmup_steps=0)
    opt = build_optimizer(model, cfg, total_steps=10)
    logits = model(ids)
    logits.float().logsumexp(-1).mean().backward()
    opt.step()
    assert opt.last_qk_clip is not None and opt.last_qk_clip.clipped_heads == 1
    after = _max_logits(model, ids)
    assert float(after[1][0]) <= TAU * (1 + 1e-5)


def test_qk_clip_off_by_default_on_in_k2():
    from cadenza.config import load_config

    assert load_config("tiny").optim.qk_clip is False
    assert load_config("k2").optim.qk_clip is True


def test_running_max_over_micro_batches():
    """With gradient accumulation every micro-batch's logits count, not only the last one's."""
    model = _model(64)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24))
    _force_head(model, layer=0, head=2, ids=ids, target=3 * TAU)
    with torch.no_grad():
        model(ids)  # micro-batch 1: head 2 far above tau
        model(ids[:1, :3])  # micro-batch 2 (last): shorter, other logits
    assert apply_qk_clip(model, TAU).clipped_heads >= 1
    assert float(_max_logits(model, ids)[0][2]) <= TAU * (1 + 1e-5)
