"""Acceptance: on gloo, loss and every gradient of the parallelized model equal one process.

Oracle: the same model (same seed) run on the whole batch in one process, loss = mean token
cross-entropy. Each spawned group runs several layouts in turn (spawning 8 processes on 2
cores costs more than the layouts themselves).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed

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


def tiny_cadenza_model():
    """cadenza.model.CausalLM, miniature: one dense block, one MoE block, MLA with q_lora."""
    from cadenza.config.model import ModelConfig
    from cadenza.model import CausalLM

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        initializer_range=0.2,
    )
    return CausalLM(cfg)


def _batch(b=8, t=8, vocab=64):
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, vocab, (b, t + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _reference(model, ids, labels):
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_layouts(rank, ws, layouts, factory):
    import torch.distributed as dist

    from cadenza.config.parallel import ParallelConfig
    from cadenza.parallel import (
        clip_grad_norm_,
        global_token_count,
        init_distributed,
        parallelize,
        shard_batch,
    )

    torch.manual_seed(0)
    base = factory()
    ids, labels = _batch()
    ref_loss, ref_grads = _reference(copy.deepcopy(base), ids, labels)
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values())).item()
    out = {}
    for name, degrees in layouts.items():
        cfg = ParallelConfig(**degrees)
        meshes = init_distributed(cfg, n_routed_experts=8)
        model = parallelize(copy.deepcopy(base), cfg, meshes)
        ids_l, lab_l, pos = shard_batch(ids, labels, meshes)
        logits = model(ids_l, positions=pos)
        n = global_token_count(lab_l.numel())
        loss = (
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), lab_l.reshape(-1), reduction="sum"
            )
            / n
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        errs = {"loss": abs(total.item() - ref_loss)}
        names = set()
        for pname, p in model.named_parameters():
            names.add(pname)
            errs[pname] = (_full(p.grad) - ref_grads[pname]).abs().max().item()
        assert names == set(ref_grads), f"{name}: parameter names changed: {names ^ set(ref_grads)}"
        # one global norm over both meshes; clipping to half of it halves every gradient
        norm = clip_grad_norm_(model.parameters(), 0.5 * ref_norm)
        errs["grad_norm"] = abs(norm.item() - ref_norm)
        for pname, p in model.named_parameters():
            want = ref_grads[pname] * (0.5 * ref_norm / (ref_norm + 1e-6))
            errs[f"clipped {pname}"] = (_full(p.grad) - want).abs().max().item()
        out[name] = errs
    return out


def _check(results):
    for rank, res in enumerate(results):
        for layout, errs in res.items():
            worst = max(errs, key=errs.get)
            assert errs[worst] <= 1e-5, f"rank {rank} layout {layout}: {worst} off by {errs[worst]}"


def _model_layouts(rank, ws):
    return compare_layouts(rank, ws, LAYOUTS_8 if ws == 8 else LAYOUTS_4, tiny_cadenza_model)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 8])
def test_layouts_match_single_process(world_size):
    _check(run_distributed(_model_layouts, world_size, timeout=300))
