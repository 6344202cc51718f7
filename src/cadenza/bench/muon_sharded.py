"""`cadenza bench muon-sharded [--world N]`: sharded Muon on N gloo processes, against
(a) a gather-everything baseline (all-gather every full parameter on every rank, run Muon on
the full tensors everywhere, keep the local shard) and (b) the PyPI package `muon-fsdp2`
(per-parameter gather to one rank, NS, scatter), on the same FSDP2 model and world size.

Also reports bytes sent per rank against the lower bound, the Newton-Schulz load balance
(max / mean FLOPs per rank), and the overlap: step time with two buckets in flight against
the separately measured communication-only and compute-only times.
Newton-Schulz runs in bf16 by default (as muon-fsdp2 does), `--ns-dtype float32` to change."""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def k2_miniature():
    """Kimi K2's proportions at laptop scale: MLA with q_lora, 16 routed experts + 1 shared,
    one dense layer then MoE layers."""
    from cadenza.config.model import ModelConfig

    return ModelConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )


def _timeit(fn, repeats: int) -> float:
    import torch.distributed as dist

    times = []
    fn()  # warm-up
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def _worker(rank, world, repeats, layout, ns_dtype):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from cadenza.config.parallel import ParallelConfig
    from cadenza.model import CausalLM
    from cadenza.model.units import param_units
    from cadenza.optim import Muon
    from cadenza.optim.newton_schulz import newton_schulz_
    from cadenza.optim.sharded import ShardedMuon
    from cadenza.parallel import init_distributed, parallelize

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = k2_miniature()
    base = CausalLM(cfg)
    pcfg = ParallelConfig(**layout)
    meshes = init_distributed(pcfg, n_routed_experts=cfg.n_routed_experts)
    model = parallelize(copy.deepcopy(base), pcfg, meshes)
    params = [(n, p, u) for n, p, u in param_units(model) if u.kind != "adamw"]
    g = torch.Generator().manual_seed(1)
    for _, p, _ in params:
        full = torch.randn(p.shape, generator=g)
        p.grad = torch.zeros_like(p)
        p.grad.to_local().copy_(full[_box_slices(p)])
    kw = dict(lr=0.01, momentum=0.95, nesterov=True, ns_dtype=ns_dtype)
    out: dict = {}

    opt = ShardedMuon(
        params, adjust_lr="match_rms_adamw", max_in_flight=2, bucket_numel=1 << 20, **kw
    )
    out["ours_s"] = _timeit(opt.step, repeats)
    out["bytes_sent"] = opt.last_step_bytes
    out["plan_bytes"] = opt.plan.bytes_per_rank(4)[rank]
    out["lower_bound_total"] = opt.plan.lower_bound_bytes(4)
    out["total_bytes"] = opt.plan.total_bytes(4)
    out["load_balance"] = opt.plan.load_balance()
    out["buckets"] = len(opt.plan.buckets)
    opt1 = ShardedMuon(
        params, adjust_lr="match_rms_adamw", max_in_flight=1, bucket_numel=1 << 20, **kw
    )
    out["ours_1_in_flight_s"] = _timeit(opt1.step, repeats)

    # Communication only: the same transfers with Newton-Schulz replaced by the identity.
    comm = ShardedMuon(
        params, adjust_lr="match_rms_adamw", max_in_flight=2, bucket_numel=1 << 20, **kw
    )
    comm._ns = lambda stack, group: stack
    out["comm_only_s"] = _timeit(comm.step, repeats)

    # Compute only: this rank's Newton-Schulz work, same batches, no communication.
    stacks = [
        torch.randn(len(opt.plan.owned(b, rank)), *b.shape)
        for b in opt.plan.buckets
        if opt.plan.owned(b, rank)
    ]
    out["compute_only_s"] = _timeit(
        lambda: [newton_schulz_(s.clone(), 5, "quintic", 1e-7) for s in stacks], repeats
    )

    # (a) gather everything: every rank all-gathers each full gradient and runs full Muon.
    full_params = [(n, torch.zeros(p.shape), u) for n, p, u in params]
    full_opt = Muon(full_params, adjust_lr="match_rms_adamw", **kw)

    @torch.no_grad()
    def gather_all():
        for (_, p, _), (_, fp, _) in zip(params, full_params):
            fp.grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        full_opt.step()
        for (_, p, _), (_, fp, _) in zip(params, full_params):
            p.to_local().copy_(fp[_box_slices(p)])

    out["gather_all_s"] = _timeit(gather_all, repeats)

    # (b) muon-fsdp2 (1-D FSDP meshes only)
    try:
        import muon_fsdp2

        plist = [p for _, p, _ in params]
        if all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for p in plist):
            mf = muon_fsdp2.Muon([dict(params=plist, lr=0.01, momentum=0.95, use_muon=True)])
            saved = [p.grad.to_local().clone() for p in plist]

            @torch.no_grad()
            def mf_step():
                mf.step()  # it overwrites .grad with the update: restore for the next repeat
                for p, s in zip(plist, saved):
                    p.grad.to_local().copy_(s)

            out["muon_fsdp2_s"] = _timeit(mf_step, repeats)
        else:
            out["muon_fsdp2_s"] = None
            out["muon_fsdp2_note"] = "muon-fsdp2 supports 1-D FSDP meshes only"
    except ImportError:
        out["muon_fsdp2_s"] = None
        out["muon_fsdp2_note"] = "muon-fsdp2 not installed"
    all_bytes = [0] * world
    t = torch.tensor([out["bytes_sent"]], dtype=torch.float64)
    gathered = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    all_bytes = [int(x.item()) for x in gathered]
    out["bytes_sent_per_rank"] = all_bytes
    return out


def _box_slices(p):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return tuple(slice(None) for _ in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="cadenza bench muon-sharded", description=__doc__)
    ap.add_argument("--world", type=int, default=4, help="gloo processes (<= 8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--layout",
        default="fsdp",
        choices=["fsdp", "dual"],
        help="fsdp: shard=world everywhere; dual: dense shard=world/2 x cp=2, ep=world",
    )
    args = ap.parse_args(argv)
    from cadenza.parallel.spawn import run_distributed

    w = args.world
    layout = (
        dict(shard=w) if args.layout == "fsdp" else dict(shard=w // 2, cp=2, ep=w, expert_shard=1)
    )
    res = run_distributed(_worker, w, args.repeats, layout, args.ns_dtype, timeout=1200)
    r0 = res[0]
    step = max(r["ours_s"] for r in res)
    gather_all = max(r["gather_all_s"] for r in res)
    mf = r0.get("muon_fsdp2_s")
    comm, compute = max(r["comm_only_s"] for r in res), max(r["compute_only_s"] for r in res)
    print(
        f"sharded Muon on {w} gloo processes, layout {layout}, K2-miniature, {args.ns_dtype} NS, "
        f"median of {args.repeats}"
    )
    print(
        f"  ours (2 buckets in flight): {step * 1e3:8.1f} ms/step "
        f"(1 in flight: {max(r['ours_1_in_flight_s'] for r in res) * 1e3:.1f} ms)"
    )
    print(
        f"  (a) gather-everything:      {gather_all * 1e3:8.1f} ms/step -> ratio {step / gather_all:.2f}x"
    )
    if mf:
        print(f"  (b) muon-fsdp2:             {mf * 1e3:8.1f} ms/step -> ratio {step / mf:.2f}x")
    else:
        print(f"  (b) muon-fsdp2: not run ({r0.get('muon_fsdp2_note')})")
    print(
        f"  bytes sent per rank: {r0['bytes_sent_per_rank']}; total {r0['total_bytes']:,} vs lower "
        f"bound {r0['lower_bound_total']:,} -> {r0['total_bytes'] / max(r0['lower_bound_total'], 1):.3f}x"
    )
    print(
        f"  NS load balance (max/mean FLOPs): {r0['load_balance']:.3f} over {r0['buckets']} buckets"
    )
    print(
        f"  overlap: comm-only {comm * 1e3:.1f} ms + compute-only {compute * 1e3:.1f} ms = "
        f"{(comm + compute) * 1e3:.1f} ms vs step {step * 1e3:.1f} ms"
    )
    return {
        "world": w,
        "layout": layout,
        "step_s": step,
        "gather_all_s": gather_all,
        "ratio_vs_gather_all": step / gather_all,
        "muon_fsdp2_s": mf,
        "ratio_vs_muon_fsdp2": (step / mf) if mf else None,
        "bytes_sent_per_rank": r0["bytes_sent_per_rank"],
        "total_bytes": r0["total_bytes"],
        "lower_bound_bytes": r0["lower_bound_total"],
        "load_balance": r0["load_balance"],
        "comm_only_s": comm,
        "compute_only_s": compute,
        "one_in_flight_s": max(r["ours_1_in_flight_s"] for r in res),
    }
