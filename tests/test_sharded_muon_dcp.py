"""Sharded Muon's momentum is stored sharded like the parameters and goes through DCP:
saved on 8 ranks (dense shard=4 x cp=2, experts ep=8), it restores identically there and on
4 ranks in another layout, and the restored optimizer keeps stepping exactly like
single-process Muon that never stopped.

Oracle: the full tensors gathered before saving, and cadenza.optim.Muon on the full model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_distributed
from test_sharded_muon import _model, _shard_of

SAVE_LAYOUT = dict(shard=4, cp=2, ep=8, expert_shard=1)
LOAD_LAYOUT = dict(replicate=2, shard=2, expert_shard=2, ep=2)
KW = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_dtype="float32")


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(layout, seed):
    from cadenza.config.parallel import ParallelConfig
    from cadenza.model.units import param_units
    from cadenza.optim.sharded import ShardedMuon
    from cadenza.parallel import init_distributed, parallelize

    torch.manual_seed(seed)
    cfg = ParallelConfig(**layout)
    meshes = init_distributed(cfg, n_routed_experts=8)
    model = parallelize(_model(awkward=False), cfg, meshes)
    params = [(n, p, u) for n, p, u in param_units(model) if u.kind != "adamw"]
    return model, ShardedMuon(params, **KW), params


def _step(params, step, ref=None):
    g = torch.Generator().manual_seed(100 + step)
    for i, (_, p, _) in enumerate(params):
        full = torch.randn(p.shape, generator=g)
        p.grad = _shard_of(full, p)
        if ref is not None:
            ref[i][1].grad = full.clone()


def _snapshot(params, opt):
    out = {}
    for name, p, _ in params:
        out[f"param/{name}"] = _full(p.detach()).clone()
        out[f"momentum/{name}"] = _full(opt.state[p]["momentum_buffer"]).clone()
    return out


def _save(rank, ws, path):
    from cadenza.parallel import checkpoint

    model, opt, params = _build(SAVE_LAYOUT, 0)
    for s in range(2):
        _step(params, s)
        opt.step()
    saved = _snapshot(params, opt)
    checkpoint.save(path, model, opt, extra={"step": 2})
    fresh, fopt, fparams = _build(SAVE_LAYOUT, 1)
    checkpoint.load(path, fresh, fopt)
    err = max((saved[k] - v).abs().max().item() for k, v in _snapshot(fparams, fopt).items())
    return (saved if rank == 0 else None), err


def _load_elsewhere(rank, ws, path, saved):
    from cadenza.model.units import param_units
    from cadenza.optim import Muon
    from cadenza.parallel import checkpoint

    model, opt, params = _build(LOAD_LAYOUT, 1)
    checkpoint.load(path, model, opt)
    err = max((saved[k] - v).abs().max().item() for k, v in _snapshot(params, opt).items())
    # Single-process Muon resumed from the same state takes the same third step.
    ref_model = copy.deepcopy(_model(awkward=False))
    ref = [(n, p, u) for n, p, u in param_units(ref_model) if u.kind != "adamw"]
    with torch.no_grad():
        for name, p, _ in ref:
            p.copy_(saved[f"param/{name}"])
    ref_opt = Muon(ref, **KW)
    for name, p, _ in ref:
        ref_opt.state[p]["momentum_buffer"] = saved[f"momentum/{name}"].clone()
    _step(params, 2, ref)
    opt.step()
    ref_opt.step()
    step_err = max(
        (_full(p.detach()) - rp).abs().max().item() for (_, p, _), (_, rp, _) in zip(params, ref)
    )
    return err, step_err


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_muon_state_round_trip_and_reshard(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_distributed(_save, 8, path, timeout=300)
    saved = results[0][0]
    assert all(err == 0.0 for _, err in results), [e for _, e in results]
    for err, step_err in run_distributed(_load_elsewhere, 4, path, saved, timeout=300):
        assert err == 0.0
        assert step_err <= 1e-6
