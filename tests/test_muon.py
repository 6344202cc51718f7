"""Muon against torch.optim.Muon (plain 2-D) and against per-unit updates assembled by hand."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

import cadenza.optim.muon as muon_mod
from cadenza.model.units import Units
from cadenza.optim.muon import Muon, muon_unit_update, unit_scale

torch.set_num_threads(1)

QUINTIC = (3.4445, -4.7750, 2.0315)


def fp32_ns(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Independent fp32 iteration on one matrix (no fused ops)."""
    X = G.float()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(float(X.norm()), 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = QUINTIC[0] * X + (QUINTIC[1] * A + QUINTIC[2] * (A @ A)) @ X
    return X.T if tall else X


def _grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(steps)]


SHAPES = [(24, 40), (40, 24), (24, 40), (32, 32), (60, 12)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True),
        dict(lr=0.05, weight_decay=0.0, momentum=0.9, nesterov=False),
        dict(lr=0.01, weight_decay=0.05, momentum=0.95, nesterov=True, adjust_lr="match_rms_adamw"),
    ],
)
def test_plain_2d_matches_torch_muon_over_10_steps(kwargs):
    init = [torch.randn(*s) for s in SHAPES]
    ours = [p.clone().requires_grad_() for p in init]
    theirs = [p.clone().requires_grad_() for p in init]
    torch_kwargs = dict(kwargs)
    torch_kwargs["adjust_lr_fn"] = torch_kwargs.pop("adjust_lr", "original")
    opt_ours = Muon(ours, **kwargs)
    opt_theirs = torch.optim.Muon(theirs, **torch_kwargs)
    for grads in _grads(SHAPES, 10):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    for p, q in zip(ours, theirs):
        r, c = p.shape
        scale = unit_scale(r, c, kwargs.get("adjust_lr", "original"))
        # bf16 rounding of the update: one bf16 ulp (2^-8 relative) of |lr s O| (|O| <~ 1.5),
        # accumulated over 10 steps.
        tol = 10 * kwargs["lr"] * scale * 1.5 * 2**-8
        assert (p - q).abs().max() <= tol


def test_fp32_ns_matches_reference_muon():
    """cadenza Muon with fp32 NS vs a from-the-formula Muon in the test, 10 steps."""
    lr, mu, wd = 0.02, 0.95, 0.1
    init = [torch.randn(*s) for s in SHAPES]
    ours = [p.clone().requires_grad_() for p in init]
    opt = Muon(ours, lr=lr, momentum=mu, weight_decay=wd, ns_dtype="float32")
    ref = [p.clone() for p in init]
    bufs = [torch.zeros_like(p) for p in init]
    for grads in _grads(SHAPES, 10):
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            bufs[i] = mu * bufs[i] + (1 - mu) * g
            v = (1 - mu) * g + mu * bufs[i]
            r, c = ref[i].shape
            ref[i] = ref[i] * (1 - lr * wd) - lr * math.sqrt(max(1, r / c)) * fp32_ns(v)
    for p, q in zip(ours, ref):
        assert (p - q).abs().max() <= 1e-6


# A miniature of the model's layouts: MLA-like rows per head with unequal (nope, rope)
# blocks, o_proj-like column blocks, stacked experts, a whole matrix, and rows whose blocks
# are all equal (kv_b-like nope == v).
H, NOPE, ROPE, D = 3, 8, 4, 20
LAYOUT = {
    "q": ((H * (NOPE + ROPE), D), Units.per_head("rows", H, NOPE, ROPE)),
    "o": ((D, H * 6), Units.per_head("cols", H, 6)),
    "experts": ((4, 10, 16), Units("experts")),
    "w": ((16, 10), Units("matrix")),
    "kv": ((H * 2 * 5, 12), Units.per_head("rows", H, 5, 5)),
    "ragged": ((3 + 7 + 2, 9), Units("rows", (3, 7, 2))),
    "ragged_cols": ((9, 5 + 2 + 5), Units("cols", (5, 2, 5))),
    "tall_experts": ((3, 16, 10), Units("experts")),  # rides with "experts" transposed
}


def _named_params():
    return {n: torch.randn(*shape).requires_grad_() for n, (shape, _) in LAYOUT.items()}


def _hand_update(params, grads, bufs, *, lr, mu, wd, adjust, ns) -> dict[str, torch.Tensor]:
    """One Muon step done unit by unit with explicit slicing (the oracle)."""
    out = {}
    for name, (_, units) in LAYOUT.items():
        g, w = grads[name], params[name].detach().clone()
        bufs[name] = bufs[name].lerp(g, 1 - mu)
        v = g.lerp(bufs[name], mu)
        w = w * (1 - lr * wd)
        for sl, (r, c) in zip(units.slices(w.shape), units.unit_shapes(w.shape)):
            w[sl] = w[sl].add(ns(v[sl]), alpha=-lr * unit_scale(r, c, adjust))
        out[name] = w
    return out


@pytest.mark.parametrize(
    "ns_dtype, adjust, tol",
    [("float32", "original", 1e-6), ("bfloat16", "match_rms_adamw", 0.0)],
)
def test_units_equal_separate_ns_per_unit(ns_dtype, adjust, tol):
    lr, mu, wd = 0.03, 0.9, 0.05
    params = _named_params()
    start = {n: p.detach().clone() for n, p in params.items()}
    opt = Muon(
        [(n, p, LAYOUT[n][1]) for n, p in params.items()],
        lr=lr,
        momentum=mu,
        weight_decay=wd,
        adjust_lr=adjust,
        ns_dtype=ns_dtype,
    )
    ns = fp32_ns if ns_dtype == "float32" else (lambda x: torch_ns(x, QUINTIC, 5, 1e-7))
    bufs = {n: torch.zeros_like(p) for n, p in params.items()}
    expected = {n: t.clone() for n, t in start.items()}
    for step_grads in range(3):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        hand_params = {n: t.clone() for n, t in expected.items()}
        expected = _hand_update(hand_params, grads, bufs, lr=lr, mu=mu, wd=wd, adjust=adjust, ns=ns)
        for n, p in params.items():
            diff = (p.detach() - expected[n]).abs().max().item()
            assert diff <= tol, (n, step_grads, diff)


def test_one_batched_ns_call_per_unit_shape(monkeypatch):
    calls = []
    real = muon_mod.newton_schulz_

    def spy(Y, *args, **kwargs):
        calls.append(tuple(Y.shape))
        return real(Y, *args, **kwargs)

    monkeypatch.setattr(muon_mod, "newton_schulz_", spy)
    params = _named_params()
    opt = Muon([(n, p, LAYOUT[n][1]) for n, p in params.items()], lr=0.01)
    for p in params.values():
        p.grad = torch.randn_like(p)
    opt.step()
    shapes = {}
    for shape, units in LAYOUT.values():
        for r, c in units.unit_shapes(shape):
            key = (min(r, c), max(r, c))  # tall units ride with their wide twin
            shapes[key] = shapes.get(key, 0) + 1
    assert sorted(calls) == sorted((k, m, n) for (m, n), k in shapes.items())


def test_muon_unit_update_core_matches_optimizer():
    """The functional core the sharded optimizer reuses gives the optimizer's bits."""
    lr, mu = 0.02, 0.95
    w = torch.randn(4, 10, 16)
    p = w.clone().requires_grad_()
    opt = Muon([("e", p, Units("experts"))], lr=lr, momentum=mu)
    m = torch.zeros_like(w)
    for _ in range(3):
        g = torch.randn_like(w)
        p.grad = g.clone()
        opt.step()
        o = muon_unit_update(g, m, momentum=mu, nesterov=True)
        w = w.add(o, alpha=-lr * unit_scale(10, 16))
    assert torch.equal(p.detach(), w)
    assert torch.equal(opt.state[p]["momentum_buffer"], m)


def test_zero_grads_give_zero_update():
    params = _named_params()
    start = {n: p.detach().clone() for n, p in params.items()}
    opt = Muon([(n, p, LAYOUT[n][1]) for n, p in params.items()], lr=0.1)
    for p in params.values():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in params.items():
        assert torch.equal(p.detach(), start[n]), n


def test_nonfinite_grads_error_or_counted_skip():
    p, q = torch.randn(8, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    opt = Muon([("a", p), ("b", q)], lr=0.1)
    p.grad, q.grad = torch.randn(8, 6), torch.randn(6, 6)
    q.grad[2, 3] = float("nan")
    with pytest.raises(FloatingPointError, match=r"\['b'\]"):
        opt.step()

    before = p.detach().clone()
    skip = Muon([("a", p), ("b", q)], lr=0.1, nonfinite="skip")
    p.grad[0, 0] = float("inf")
    skip.step()
    assert skip.skipped_steps == 1
    assert torch.equal(p.detach(), before) and not skip.state
    p.grad, q.grad = torch.randn(8, 6), torch.randn(6, 6)
    skip.step()
    assert skip.skipped_steps == 1 and not torch.equal(p.detach(), before)
    assert skip.state_dict()["skipped_steps"] == 1


def test_bad_params_get_clear_errors():
    with pytest.raises(ValueError, match="complex"):
        Muon([torch.randn(4, 4, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(ValueError, match="no declared units"):
        Muon([torch.randn(2, 4, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="adamw"):
        Muon([("emb", torch.randn(4, 4, requires_grad=True), Units("adamw"))])
    with pytest.raises(ValueError, match="row blocks sum"):
        Muon([("q", torch.randn(10, 4, requires_grad=True), Units("rows", (3, 3)))])
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([torch.randn(4, 4, requires_grad=True)], adjust_lr="none")
    p = torch.randn(4, 4, requires_grad=True)
    opt = Muon([p])
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_param_groups_match_torch_groups():
    init = [torch.randn(8, 4), torch.randn(6, 6), torch.randn(5, 9)]
    ours = [p.clone().requires_grad_() for p in init]
    theirs = [p.clone().requires_grad_() for p in init]
    opt = Muon([{"params": ours[:2], "lr": 0.1}, {"params": ours[2:]}], lr=0.01, weight_decay=0.1)
    ref = torch.optim.Muon(
        [{"params": theirs[:2], "lr": 0.1}, {"params": theirs[2:]}], lr=0.01, weight_decay=0.1
    )
    for grads in _grads([p.shape for p in init], 3):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert (p - q).abs().max() <= 3 * 0.1 * 1.5 * 2**-8


def test_state_dict_round_trip():
    def make():
        params = {n: p.detach().clone().requires_grad_() for n, p in base.items()}
        opt = Muon([(n, p, LAYOUT[n][1]) for n, p in params.items()], lr=0.02, weight_decay=0.1)
        return params, opt

    base = _named_params()
    grads = [{n: torch.randn_like(p) for n, p in base.items()} for _ in range(6)]

    def run(params, opt, gs):
        for g in gs:
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()

    cont_p, cont_o = make()
    run(cont_p, cont_o, grads)

    first_p, first_o = make()
    run(first_p, first_o, grads[:3])
    buf = io.BytesIO()
    torch.save(
        {"params": {n: p.detach() for n, p in first_p.items()}, "optim": first_o.state_dict()}, buf
    )
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed_p, resumed_o = make()
    with torch.no_grad():
        for n, p in resumed_p.items():
            p.copy_(saved["params"][n])
    resumed_o.load_state_dict(saved["optim"])
    run(resumed_p, resumed_o, grads[3:])
    for n in base:
        assert torch.equal(resumed_p[n].detach(), cont_p[n].detach()), n

    other = Muon(
        [(n, p, Units("matrix") if n == "w" else LAYOUT[n][1]) for n, p in _named_params().items()][
            :-1
        ]
        + [("ragged", torch.randn(12, 9, requires_grad=True), Units("rows", (6, 6)))],
        lr=0.02,
    )
    with pytest.raises(ValueError, match="unit layouts"):
        other.load_state_dict(saved["optim"])


def test_tiny_model_units_equal_hand_assembled_update():
    """On the real model's declarations (MLA heads, o_proj columns, experts), fp32 NS."""
    import dataclasses

    from cadenza.config.model import tiny_model
    from cadenza.model import CausalLM
    from cadenza.model.units import param_units

    model = CausalLM(dataclasses.replace(tiny_model(), num_hidden_layers=2))
    declared = [(n, p, u) for n, p, u in param_units(model) if u.kind != "adamw"]
    start = {n: p.detach().clone() for n, p, _ in declared}
    grads = {n: torch.randn_like(p) for n, p, _ in declared}
    for n, p, _ in declared:
        p.grad = grads[n].clone()
    lr, mu, wd = 0.02, 0.95, 0.1
    Muon(declared, lr=lr, momentum=mu, weight_decay=wd, ns_dtype="float32").step()
    for n, p, units in declared:
        g = grads[n]
        v = g.lerp(torch.zeros_like(g).lerp(g, 1 - mu), mu)
        w = start[n] * (1 - lr * wd)
        for sl, (r, c) in zip(units.slices(w.shape), units.unit_shapes(w.shape)):
            w[sl] = w[sl] - lr * unit_scale(r, c) * fp32_ns(v[sl])
        assert (p.detach() - w).abs().max() <= 1e-6, n


def test_resume_from_torch_muon_state():
    """torch.optim.Muon's state dict loads into cadenza's Muon (same momentum_buffer layout)."""
    init = [torch.randn(*s) for s in SHAPES]
    grads = _grads(SHAPES, 6)
    theirs = [p.clone().requires_grad_() for p in init]
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    for step, gs in enumerate(grads):
        for p, g in zip(theirs, gs):
            p.grad = g.clone()
        ref.step()
        if step == 2:
            ours = [p.detach().clone().requires_grad_() for p in theirs]
            opt = Muon(ours, lr=0.02, weight_decay=0.1)
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch shares buffers
    for gs in grads[3:]:
        for p, g in zip(ours, gs):
            p.grad = g.clone()
        opt.step()
    for p, q in zip(ours, theirs):
        assert (p - q).abs().max() <= 3 * 0.02 * 2.3 * 1.5 * 2**-8
