"""`cadenza bench mesh-traffic`: bytes each rank sends per training step, dual mesh vs one mesh.

A K2-miniature model (K2's structure: MLA with q/kv latents, one dense block then MoE blocks
with a shared expert and sigmoid top-k routing; small widths) runs one real training step
(forward, backward, AdamW) on local gloo processes, and every collective is counted:

- dual mesh (cadenza): dense (shard=S, cp=C) and experts (ep=E) on max(S*C, E) = 8 ranks;
- baseline, one shared mesh (dp, cp, ep) with cp and ep as separate dimensions: needs
  C * E = 16 ranks; dense weights shard over all of them, experts over ep and FSDP over cp.

Both see the same global batch. Bytes a rank sends, per collective (ring/pairwise, the
data that must leave the rank): all-gather (P-1) x input, reduce-scatter (P-1)/P x input,
all-reduce 2 (P-1)/P x input, all-to-all the rows sent to other ranks. Counts are exact
(deterministic), so one step is measured; wall time on shared CPU cores is not the point.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections import defaultdict

import torch

DUAL = dict(shard=4, cp=2, expert_shard=1, ep=8)  # 8 ranks
SHARED = dict(shard=8, cp=2, expert_shard=2, ep=8)  # 16 ranks: the (cp=2, ep=8) single mesh


def k2_miniature():
    from cadenza.config.model import ModelConfig

    return ModelConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def count_collectives(counter: dict[str, float]):
    """Add the bytes this rank sends to `counter[kind]` for every collective while active."""
    import torch.distributed as dist

    def size(group) -> int:
        return dist.get_world_size(group)

    def gather(a):  # (output, input, group): input leaves to each of P-1 ranks
        return _nbytes(a[1]) * (size(a[-1]) - 1)

    def scatter(a):  # (output, input, op, group): all but the own chunk leaves
        return _nbytes(a[1]) * (size(a[-1]) - 1) // size(a[-1])

    def reduce(a):  # (tensor, op, group): ring reduce-scatter + all-gather
        return 2 * _nbytes(a[0]) * (size(a[-1]) - 1) // size(a[-1])

    def a2a(a):  # (output, input, out_splits, in_splits, group): rows for other ranks
        inp, in_splits, group = a[1], a[3], a[4]
        p, me = size(group), dist.get_rank(group)
        row = _nbytes(inp) // max(inp.shape[0], 1)
        splits = in_splits or [inp.shape[0] // p] * p
        return row * (sum(splits) - splits[me])

    arg_names = {
        "all_gather_single": ("output_tensor", "input_tensor", "group"),
        "all_gather_into_tensor": ("output_tensor", "input_tensor", "group"),
        "reduce_scatter_single": ("output", "input", "op", "group"),
        "reduce_scatter_tensor": ("output", "input", "op", "group"),
        "all_reduce": ("tensor", "op", "group"),
        "all_to_all_single": (
            "output",
            "input",
            "output_split_sizes",
            "input_split_sizes",
            "group",
        ),
    }
    kinds = {
        "all_gather_single": ("all-gather", gather),
        "all_gather_into_tensor": ("all-gather", gather),
        "reduce_scatter_single": ("reduce-scatter", scatter),
        "reduce_scatter_tensor": ("reduce-scatter", scatter),
        "all_reduce": ("all-reduce", reduce),
        "all_to_all_single": ("all-to-all", a2a),
    }

    def wrap(name):
        orig = getattr(dist, name)
        sig = inspect.signature(orig)
        kind, sent = kinds[name]

        def counted(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            counter[kind] += sent([bound.arguments[n] for n in arg_names[name]])
            return orig(*args, **kwargs)

        return name, orig, counted

    patches = [wrap(name) for name in kinds if hasattr(dist, name)]
    for name, _, counted in patches:
        setattr(dist, name, counted)
    try:
        yield counter
    finally:
        for name, orig, _ in patches:
            setattr(dist, name, orig)


def _one_step(rank: int, world_size: int, degrees: dict, batch: int, seq_len: int) -> dict:
    import torch.nn.functional as F

    from cadenza.config.parallel import ParallelConfig
    from cadenza.model import CausalLM
    from cadenza.parallel import global_token_count, init_distributed, parallelize, shard_batch

    cfg = k2_miniature()
    torch.manual_seed(0)
    model = CausalLM(cfg)
    pcfg = ParallelConfig(**degrees)
    meshes = init_distributed(pcfg, n_routed_experts=cfg.n_routed_experts)
    model = parallelize(model, pcfg, meshes)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    ids, labels, pos = shard_batch(seq[:, :-1], seq[:, 1:], meshes)
    n = global_token_count(labels.numel())
    counter: dict[str, float] = defaultdict(float)
    with count_collectives(counter):
        logits = model(ids, positions=pos)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n
        loss.backward()
        optim.step()
    return dict(counter)


def _summary(per_rank: list[dict], tokens: int) -> dict:
    kinds = sorted({k for r in per_rank for k in r})
    totals = [sum(r.values()) for r in per_rank]
    return {
        "ranks": len(per_rank),
        "tokens_per_rank": tokens // len(per_rank),
        "bytes_per_token": sum(totals) / tokens,
        "bytes_per_rank_mean": sum(totals) / len(totals),
        "bytes_per_rank_max": max(totals),
        "bytes_all_ranks": sum(totals),
        "by_kind_mean": {k: sum(r.get(k, 0) for r in per_rank) / len(per_rank) for k in kinds},
    }


def run(argv: list[str]) -> dict:
    from cadenza.parallel.mesh import check_layout, describe
    from cadenza.parallel.spawn import run_distributed

    ap = argparse.ArgumentParser(
        prog="cadenza bench mesh-traffic", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args(argv)
    cfg = k2_miniature()
    results = {}
    for name, degrees in (("dual", DUAL), ("shared", SHARED)):
        world = degrees["shard"] * degrees["cp"]
        layout = check_layout(
            world,
            dict(shard=degrees["shard"], cp=degrees["cp"]),
            dict(shard=degrees["expert_shard"], ep=degrees["ep"]),
            cfg.n_routed_experts,
        )
        print(f"[{name}] {describe(layout)}", flush=True)
        per_rank = run_distributed(_one_step, world, degrees, args.batch, args.seq_len, timeout=600)
        results[name] = _summary(per_rank, args.batch * args.seq_len)
    d, s = results["dual"], results["shared"]
    mib = 2**20
    print(
        f"\nK2-miniature: {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, "
        f"{cfg.num_hidden_layers} layers, batch {args.batch} x {args.seq_len} tokens, one step"
    )
    print(
        f"{'layout':<34}{'ranks':>6}{'tokens/rank':>12}{'MiB sent/rank':>15}{'MiB all ranks':>15}{'KiB/token':>11}"
    )
    for label, r in (("dual mesh  cp=2 | ep=8", d), ("shared mesh cp=2 x ep=8 (baseline)", s)):
        print(
            f"{label:<34}{r['ranks']:>6}{r['tokens_per_rank']:>12}"
            f"{r['bytes_per_rank_mean'] / mib:>15.2f}{r['bytes_all_ranks'] / mib:>15.2f}"
            f"{r['bytes_per_token'] / 1024:>11.2f}"
        )
    for label, r in (("dual", d), ("shared", s)):
        parts = ", ".join(f"{k} {v / mib:.2f}" for k, v in r["by_kind_mean"].items())
        print(f"  {label} per rank, MiB: {parts}")
    ratios = {
        "ranks_dual_over_shared": d["ranks"] / s["ranks"],
        "bytes_per_rank_dual_over_shared": d["bytes_per_rank_mean"] / s["bytes_per_rank_mean"],
        "bytes_all_ranks_dual_over_shared": d["bytes_all_ranks"] / s["bytes_all_ranks"],
    }
    # same global batch: total bytes / token ratio == total bytes ratio
    print(
        f"ratio dual/shared: ranks {ratios['ranks_dual_over_shared']:.2f}, bytes per rank "
        f"{ratios['bytes_per_rank_dual_over_shared']:.2f}, total bytes "
        f"{ratios['bytes_all_ranks_dual_over_shared']:.2f}"
    )
    return {"dual": d, "shared": s, "ratios": ratios, "batch": args.batch, "seq_len": args.seq_len}
