"""Dual meshes, expert-parallel dispatch/combine, context-parallel attention, failure handling.

Oracles: plain single-process computations on the full data (every rank can rebuild every
other rank's inputs from its seed), and the layout rules written out by hand.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import DistributedTestError, run_distributed
from cadenza.parallel.context_parallel import load_balanced_positions
from cadenza.parallel.mesh import LayoutError, check_layout, describe, rank_groups

# ---------------------------------------------------------------- layouts (no processes)


def test_layout_resolves_and_overlaps_cp_with_ep():
    lay = check_layout(8, dense=dict(shard=4, cp=2), expert=dict(ep=8), n_routed_experts=16)
    assert lay.dense_shape == (1, 4, 2) and lay.expert_shape == (1, 1, 8)
    lay = check_layout(8, dense=dict(replicate=2, cp=2), expert=dict(replicate=2, ep=4))
    assert lay.dense_shape == (2, 2, 2) and lay.expert_shape == (2, 1, 4)


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        (dict(dense=dict(shard=3, cp=2), expert=dict(ep=8)), "dense: replicate x shard x cp"),
        (dict(dense=dict(shard=8), expert=dict(shard=2, ep=2)), "expert: replicate x shard x ep"),
        (dict(dense=dict(shard=8), expert=dict(ep=8), n_routed_experts=12), "divisible by ep"),
        (dict(dense=dict(shard=-1, cp=-1)), "at most one inferred"),
        (dict(dense=dict(shard=0)), "positive integers"),
        (dict(dense=dict(shards=8)), "unknown key"),
        (dict(dense=dict(cp=3)), "does not divide world size"),
    ],
)
def test_invalid_layouts_name_the_rule(kwargs, rule):
    with pytest.raises(LayoutError, match=rule):
        check_layout(8, **kwargs)


def test_rank_groups_row_major():
    g = rank_groups((2, 2, 2), ("dp_replicate", "dp_shard", "cp"))
    assert g["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = describe(check_layout(8, dense=dict(replicate=2, cp=2), expert=dict(ep=8)))
    assert "ep             [[0, 1, 2, 3, 4, 5, 6, 7]]" in text


def test_head_tail_split_balances_causal_work():
    pos = load_balanced_positions(16, 4)
    assert sorted(pos.flatten().tolist()) == list(range(16))
    work = (pos + 1).sum(1)  # keys each rank's queries attend to under a causal mask
    assert (work == work[0]).all()
    with pytest.raises(ValueError, match="divisible by 2 x cp"):
        load_balanced_positions(12, 4)


# ---------------------------------------------------------------- multi-process


class ToyExperts(nn.Module):
    """Stacked SwiGLU experts called on tokens grouped by expert (the model's contract)."""

    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(e, i, h) * 0.3)
        self.w_up = nn.Parameter(torch.randn(e, i, h) * 0.3)
        self.w_down = nn.Parameter(torch.randn(e, h, i) * 0.3)

    def forward(self, x, counts):
        outs = []
        for j, xs in enumerate(torch.split(x, counts.tolist())):
            outs.append((F.silu(xs @ self.w_gate[j].T) * (xs @ self.w_up[j].T)) @ self.w_down[j].T)
        return torch.cat(outs)


def _rank_tokens(rank: int, e: int, h: int, skewed: bool):
    """Uneven token counts; odd experts get none. Skewed: rank 0 sends nothing and every
    token goes to experts 0 and 2, so the second rank of each ep group receives nothing."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 2 * rank if skewed else 3 + 2 * rank
    x = torch.randn(n, h, generator=g)
    expert = torch.randint(0, 2 if skewed else e // 2, (n,), generator=g) * 2
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=e)
    w = torch.randn(n, h, generator=g)
    return x[order], counts, w


def _maxerr(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _expert_parallel_case(rank, ws, skewed):
    """The model's own Experts (grouped matmuls) wrapped for EP vs a plain per-expert loop."""
    from cadenza.model.moe import Experts
    from cadenza.parallel.expert_parallel import ExpertParallel
    from cadenza.parallel.mesh import build_meshes

    e, h, i = 8, 8, 4
    meshes = build_meshes(ws, dense=dict(shard=ws), expert=dict(replicate=2, ep=ws // 2))
    ep_mesh = meshes.expert["ep"]
    torch.manual_seed(0)
    full = ToyExperts(e, h, i)
    ep_mod = ExpertParallel(Experts(e, h, i), ep_mesh)
    with torch.no_grad():
        for n in ("w_gate", "w_up", "w_down"):
            getattr(ep_mod, n).to_local().copy_(
                getattr(full, n).chunk(ep_mesh.size())[ep_mesh.get_local_rank()]
            )
    x, counts, w = _rank_tokens(rank, e, h, skewed)
    x = x.requires_grad_(True)
    y = ep_mod(x, counts)
    (y * w).sum().backward()
    # oracle: the full experts on this rank's tokens, and on the whole ep group's tokens
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = full(x_ref, counts)
    (y_ref * w).sum().backward(inputs=[x_ref])
    group = ep_mesh.mesh.tolist()
    for r in group:
        if r != rank:
            xr, cr, wr = _rank_tokens(r, e, h, skewed)
            (full(xr, cr) * wr).sum().backward()
        else:
            (full(x.detach(), counts) * w).sum().backward()
    lo = ep_mesh.get_local_rank() * (e // ep_mesh.size())
    errs = {"y": _maxerr(y, y_ref), "x.grad": _maxerr(x.grad, x_ref.grad)}
    for n in ("w_gate", "w_up", "w_down"):
        got = getattr(ep_mod, n).grad.to_local()
        want = getattr(full, n).grad[lo : lo + e // ep_mesh.size()]
        errs[n] = _maxerr(got, want)
    return errs


def _context_parallel_case(rank, ws):
    import torch.distributed as dist

    from cadenza.parallel.context_parallel import KVGather, causal_mask, split_sequence
    from cadenza.parallel.mesh import build_meshes

    meshes = build_meshes(ws, dense=dict(shard=ws // 2, cp=2), expert=dict(ep=ws))
    cp_mesh = meshes.dense["cp"]
    b, t, d, heads = 2, 8, 8, 2
    torch.manual_seed(1)
    proj = nn.Linear(d, 3 * d)
    x_full = torch.randn(b, t, d, requires_grad=True)

    def attend(x, q_pos, gather=None):
        q, k, v = proj(x).view(b, -1, 3, heads, d // heads).unbind(2)
        mask = causal_mask(q_pos, q_pos)
        if gather is not None:
            k, v, mask = gather(k, v, None)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return o.transpose(1, 2).reshape(b, -1, d)

    x_local, pos = split_sequence(x_full, cp_mesh.get_local_rank(), cp_mesh.size())
    out = attend(x_local, pos, KVGather(cp_mesh.get_group()))
    w = torch.randn(b, t, d, generator=torch.Generator().manual_seed(7))
    (out * w[:, pos]).sum().backward()
    grads = [proj.weight.grad.clone(), proj.bias.grad.clone(), x_full.grad.clone()]
    for g_ in grads:
        dist.all_reduce(g_, group=cp_mesh.get_group())
    # oracle: one process, the whole sequence, plain causal attention
    proj.zero_grad()
    x_ref = x_full.detach().clone().requires_grad_(True)
    ref = attend(x_ref, torch.arange(t))
    (ref * w).sum().backward()
    return {
        "out": (out - ref[:, pos]).abs().max().item(),
        "w.grad": (grads[0] - proj.weight.grad).abs().max().item(),
        "b.grad": (grads[1] - proj.bias.grad).abs().max().item(),
        "x.grad": (grads[2] - x_ref.grad).abs().max().item(),
    }


def _primitives(rank, ws):
    return {
        "ep": _expert_parallel_case(rank, ws, skewed=False),
        "ep, empty ranks": _expert_parallel_case(rank, ws, skewed=True),
        "cp": _context_parallel_case(rank, ws),
    }


@pytest.mark.distributed
def test_expert_and_context_parallel_match_single_process():
    results = run_distributed(_primitives, 4, timeout=180)
    for rank, res in enumerate(results):
        for case, errs in res.items():
            for name, err in errs.items():
                assert err <= 1e-5, f"rank {rank} {case} {name}: max abs error {err}"


def _one_rank_raises(rank, ws):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on purpose")
    x = torch.ones(1)
    dist.all_reduce(x)  # the other ranks block here until the helper ends them
    return x.item()


@pytest.mark.distributed
def test_a_failing_rank_ends_the_group_with_its_error():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank 1 of 3 failed[\s\S]*boom on purpose"):
        run_distributed(_one_rank_raises, 3, timeout=120, grace=3)
    assert time.monotonic() - t0 < 60


def _bad_layout(rank, ws):
    from cadenza.parallel.mesh import build_meshes

    build_meshes(ws, dense=dict(shard=2, cp=2), expert=dict(ep=3))


@pytest.mark.distributed
def test_invalid_layout_fails_on_every_rank_before_any_collective():
    with pytest.raises(
        DistributedTestError,
        match=r"ranks \[\d, \d, \d\] failed too[\s\S]*expert: replicate x shard x ep",
    ):
        run_distributed(_bad_layout, 4, timeout=60, grace=20)


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    from cadenza.parallel import clip_grad_norm_, global_token_count

    a = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    got = clip_grad_norm_(a, 0.5)
    want = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert torch.allclose(got, want)
    for p, q in zip(a, b):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    assert global_token_count(17) == 17  # one process: nothing to sum


def test_cli_plan_prints_groups_and_rejects_bad_layouts():
    from typer.testing import CliRunner

    from cadenza.cli.main import app

    def plan(*args):
        return CliRunner().invoke(app, ["parallel", "plan", *args])

    ok = plan("8", "parallel.shard=4", "parallel.cp=2", "parallel.ep=8", "parallel.expert_shard=1")
    assert ok.exit_code == 0, ok.output
    assert "cp             [[0, 1], [2, 3], [4, 5], [6, 7]]" in ok.output
    assert "ep             [[0, 1, 2, 3, 4, 5, 6, 7]]" in ok.output
    bad = plan("8", "parallel.ep=16", "parallel.expert_shard=1")
    assert bad.exit_code == 2
    assert "expert: replicate x shard x ep = world size" in bad.output
