"""Sharded Muon equals single-process Muon on the full tensors (fp32 Newton-Schulz, <= 1e-6).

Oracle: cadenza.optim.Muon (itself checked against torch.optim.Muon) on the unsharded model
with the same gradients. Every rank builds the same full gradients from a seed; the sharded
run gets each rank's shard of them, as FSDP2's reduce-scatter would deliver.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_distributed
from test_parallel_layouts import tiny_cadenza_model

# Layouts of the dual-mesh tests (8 experts) plus awkward shapes (6 experts, odd dims).
LAYOUTS_8 = {
    "fsdp8": dict(shard=8),
    "hsdp2x4": dict(replicate=2, shard=4),
    "shard4.cp2|ep8": dict(shard=4, cp=2, ep=8, expert_shard=1),
    "rep2.shard2.cp2|rep2.ep4": dict(replicate=2, shard=2, cp=2, expert_replicate=2, ep=4),
    "fsdp8|eshard2.ep4": dict(shard=8, expert_shard=2, ep=4),
}
LAYOUTS_4 = {
    "fsdp4": dict(shard=4),
    "shard2.cp2|ep4": dict(shard=2, cp=2, ep=4, expert_shard=1),
    "rep2.shard2|eshard2.ep2": dict(replicate=2, shard=2, expert_shard=2, ep=2),
}
AWKWARD_8 = {
    "fsdp8": dict(shard=8),
    "hsdp2x4|ep2": dict(replicate=2, shard=4, expert_shard=4, ep=2),
}
AWKWARD_4 = {
    "fsdp4": dict(shard=4),
    "hsdp2x2|ep2": dict(replicate=2, shard=2, expert_shard=2, ep=2),
}


def _model(awkward: bool):
    from cadenza.config.model import ModelConfig
    from cadenza.model import CausalLM

    if awkward:
        # 3 heads x (6 nope + 4 rope) = 30 q rows over 8 ranks (chunks of 4: heads straddle
        # ranks); 6 experts over 8 shard ranks (two ranks hold no expert); kv_a rows 12 + 4.
        cfg = ModelConfig(
            vocab_size=50,
            hidden_size=20,
            intermediate_size=28,
            moe_intermediate_size=10,
            num_hidden_layers=2,
            num_attention_heads=3,
            q_lora_rank=10,
            kv_lora_rank=12,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=6,
            n_routed_experts=6,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
        )
    else:
        return tiny_cadenza_model()  # the dual-mesh tests' model
    return CausalLM(cfg)


def _shard_of(full, p):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return full.clone()
    # The shard FSDP2 holds of `full` (an independent route: DTensor's own offsets).
    shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].contiguous()
    assert local.shape == p.to_local().shape
    return DTensor.from_local(
        local, p.device_mesh, p.placements, shape=full.shape, stride=full.stride(), run_check=False
    )


def compare(rank, ws, layouts, awkward, steps=3):
    from torch.distributed.tensor import DTensor

    from cadenza.config.parallel import ParallelConfig
    from cadenza.model.units import param_units
    from cadenza.optim import Muon
    from cadenza.optim.sharded import ShardedMuon
    from cadenza.parallel import init_distributed, parallelize

    torch.manual_seed(0)
    base = _model(awkward)
    n_experts = base.cfg.n_routed_experts if hasattr(base, "cfg") else None
    kw = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_dtype="float32")
    out = {}
    for name, degrees in layouts.items():
        ref = copy.deepcopy(base)
        ref_params = [(n, p, u) for n, p, u in param_units(ref) if u.kind != "adamw"]
        ref_opt = Muon(ref_params, adjust_lr="match_rms_adamw", **kw)
        cfg = ParallelConfig(**degrees)
        meshes = init_distributed(cfg, n_routed_experts=n_experts)
        model = parallelize(copy.deepcopy(base), cfg, meshes)
        params = [(n, p, u) for n, p, u in param_units(model) if u.kind != "adamw"]
        assert [n for n, _, _ in params] == [n for n, _, _ in ref_params]
        opt = ShardedMuon(params, adjust_lr="match_rms_adamw", bucket_numel=2048, **kw)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            for (_, rp, _), (_, p, _) in zip(ref_params, params):
                full = torch.randn(rp.shape, generator=g)
                rp.grad = full
                p.grad = _shard_of(full, p)
            ref_opt.step()
            opt.step()
        worst = 0.0
        for (_, rp, _), (_, p, _) in zip(ref_params, params):
            got = p.full_tensor() if isinstance(p, DTensor) else p
            worst = max(worst, (got - rp.detach()).abs().max().item())
        expert_bytes = None
        if degrees.get("ep", 1) > 1 and degrees.get("expert_shard", -1) == 1:
            # Experts sharded on the expert dim only: an optimizer over just them sends nothing.
            experts = [(n, p, u) for n, p, u in params if u.kind == "experts"]
            eopt = ShardedMuon(experts, **kw)
            eopt.step()
            expert_bytes = eopt.last_step_bytes
        out[name] = dict(
            err=worst,
            expert_bytes=expert_bytes,
            step_bytes=opt.last_step_bytes,
            bytes=opt.stats["bytes_sent_per_rank"][rank],
            balance=opt.stats["load_balance"],
        )
    return out


def _run(rank, ws, awkward):
    if awkward:
        return compare(rank, ws, AWKWARD_8 if ws == 8 else AWKWARD_4, True)
    return compare(rank, ws, LAYOUTS_8 if ws == 8 else LAYOUTS_4, False)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("awkward", [False, True], ids=["dual-mesh-layouts", "awkward-shapes"])
def test_sharded_equals_single_process(world_size, awkward):
    results = run_distributed(_run, world_size, awkward, timeout=300)
    for rank, res in enumerate(results):
        for layout, r in res.items():
            assert r["err"] <= 1e-6, f"rank {rank} {layout}: max abs diff {r['err']}"
            assert r["expert_bytes"] in (None, 0), f"{layout}: experts sent {r['expert_bytes']} B"
            # Bytes actually sent equal the plan's count (NS dtype fp32 here: 4 bytes/element).
            assert r["step_bytes"] == r["bytes"], (layout, r)


def _build_optimizer_matches(rank, ws):
    """build_optimizer on a parallelized model (sharded Muon + AdamW on DTensors) takes the
    same steps as on the single-process model."""
    from torch.distributed.tensor import DTensor

    from cadenza.config.optim import OptimConfig
    from cadenza.config.parallel import ParallelConfig
    from cadenza.optim import build_optimizer
    from cadenza.optim.sharded import ShardedMuon
    from cadenza.parallel import init_distributed, parallelize

    torch.manual_seed(0)
    base = _model(awkward=False)
    cfg = OptimConfig(ns_dtype="float32", warmup_steps=0)
    ref = copy.deepcopy(base)
    ref_opt = build_optimizer(ref, cfg, total_steps=10)
    pcfg = ParallelConfig(shard=2, cp=2, ep=4, expert_shard=1)
    meshes = init_distributed(pcfg, n_routed_experts=8)
    model = parallelize(copy.deepcopy(base), pcfg, meshes)
    opt = build_optimizer(model, cfg, total_steps=10)
    assert isinstance(opt.muon, ShardedMuon)
    for step in range(2):
        g = torch.Generator().manual_seed(7 + step)
        for (_, rp), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            full = torch.randn(rp.shape, generator=g)
            rp.grad = full
            p.grad = _shard_of(full, p)
        ref_opt.step()
        opt.step()
    worst = 0.0
    for (_, rp), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        got = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, (got - rp.detach()).abs().max().item())
    return worst


@pytest.mark.distributed
@pytest.mark.slow
def test_build_optimizer_uses_sharded_muon_and_matches():
    for rank, worst in enumerate(run_distributed(_build_optimizer_matches, 4, timeout=300)):
        assert worst <= 1e-5, f"rank {rank}: max abs diff {worst}"
