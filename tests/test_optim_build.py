"""build_optimizer on the tiny model: parameter split, schedule, skip/error, resume."""

from __future__ import annotations

import io
import math

import pytest
import torch

from cadenza.config import load_config
from cadenza.config.optim import OptimConfig
from cadenza.model import CausalLM
from cadenza.model.units import param_units
from cadenza.optim.build import build_optimizer
from cadenza.optim.schedule import lr_factor

torch.set_num_threads(1)


def _loss(model, ids):
    logits = model(ids)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def test_every_parameter_in_exactly_one_optimizer():
    cfg = load_config("tiny")
    model = CausalLM(cfg.model)
    opt = build_optimizer(model, cfg)
    names = opt.named_params()
    muon, adamw = set(names["muon"]), set(names["adamw"])
    assert not muon & adamw
    assert muon | adamw == {n for n, _ in model.named_parameters()}
    declared = {n: u.kind for n, _, u in param_units(model)}
    assert all(declared[n] != "adamw" for n in muon)
    assert all(declared[n] == "adamw" for n in adamw)
    assert {"embed.weight", "lm_head.weight", "norm.weight", "layers.1.mlp.router.weight"} <= adamw
    assert {"layers.1.mlp.experts.w_up", "layers.0.attn.q_b_proj.weight"} <= muon
    # weight decay on >= 2-D AdamW params only (not norms or biases)
    for g in opt.adamw.param_groups:
        for p in g["params"]:
            assert (g["weight_decay"] > 0) == (p.ndim >= 2)


def test_all_adamw_baseline():
    cfg = load_config("tiny", ["optim.optimizer=adamw"])
    opt = build_optimizer(CausalLM(cfg.model), cfg)
    assert opt.muon is None and len(opt.named_params()["adamw"]) > 0


def test_schedules():
    W, T, m = 10, 110, 0.1
    assert lr_factor(0, T, "cosine", W, m) == pytest.approx(1 / W)
    assert lr_factor(W - 1, T, "cosine", W, m) == pytest.approx(1.0)
    assert lr_factor(W, T, "cosine", W, m) == pytest.approx(1.0)
    assert lr_factor(W + 50, T, "cosine", W, m) == pytest.approx(m + (1 - m) * 0.5)
    assert lr_factor(T, T, "cosine", W, m) == pytest.approx(m)
    assert lr_factor(W + 25, T, "cosine", W, m) == pytest.approx(
        m + (1 - m) * 0.5 * (1 + math.cos(math.pi / 4))
    )
    # WSD: stable until the last 20% (22 steps), then linear to m.
    assert lr_factor(87, T, "wsd", W, m) == 1.0
    assert lr_factor(88, T, "wsd", W, m) == pytest.approx(1.0)
    assert lr_factor(99, T, "wsd", W, m) == pytest.approx(1 - (1 - m) * 11 / 22)
    assert lr_factor(T, T, "wsd", W, m) == pytest.approx(m)
    assert lr_factor(500, T, "constant", W, m) == 1.0
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(50, T, "linear", W, m)  # type: ignore[arg-type]


def test_steps_train_skip_and_resume():
    cfg = load_config("tiny", ["model.num_hidden_layers=2", "optim.warmup_steps=2"])
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    base = CausalLM(cfg.model)

    def make():
        model = CausalLM(cfg.model)
        model.load_state_dict(base.state_dict())
        return model, build_optimizer(model, cfg, total_steps=20)

    def train(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            _loss(model, ids).backward()
            opt.step()

    model, opt = make()
    first = float(_loss(model, ids).detach())
    train(model, opt, 6)
    assert float(_loss(model, ids).detach()) < first  # it learns
    assert opt.steps == 6 and opt.lrs["muon"] == pytest.approx(cfg.optim.lr * opt.lr_factor(6))

    # non-finite gradients: an error naming the parameter, or a counted skip
    opt.zero_grad()
    _loss(model, ids).backward()
    model.embed.weight.grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="embed.weight"):
        opt.step()
    opt.cfg.nonfinite = "skip"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert opt.step() is False and opt.skipped_steps == 1 and opt.steps == 6
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt.cfg.nonfinite = "error"

    # resume: 3 + (save, load) + 3 steps equals 6 straight steps
    straight_model, straight_opt = make()
    train(straight_model, straight_opt, 6)
    a_model, a_opt = make()
    train(a_model, a_opt, 3)
    buf = io.BytesIO()
    torch.save({"model": a_model.state_dict(), "optim": a_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b_model, b_opt = make()
    b_model.load_state_dict(saved["model"])
    b_opt.load_state_dict(saved["optim"])
    train(b_model, b_opt, 3)
    for (n, p), q in zip(b_model.named_parameters(), straight_model.parameters()):
        assert torch.equal(p, q), n


def test_config_validation():
    with pytest.raises(ValueError, match="momentum"):
        OptimConfig(momentum=1.5)
    from cadenza.config import ConfigError

    with pytest.raises(ConfigError, match="adjust_lr"):
        load_config("tiny", ["optim.adjust_lr=sqrt"])
