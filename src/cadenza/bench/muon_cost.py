"""`cadenza bench muon-cost [--preset k2] [--gpus N]`: predicted sharded-Muon step time for a
model's real shapes from FLOPs, bytes and stated rates (H100 defaults, overridable), split
into Newton-Schulz compute, communication and their non-overlapped part; and the smallest
GPU count that reaches the target step time (default 0.2 s, Kimi K2's published figure)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from cadenza.config.model import MODEL_PRESETS
from cadenza.model import CausalLM
from cadenza.model.units import param_units
from cadenza.optim.cost_model import (
    Hardware,
    best_layout,
    describe,
    gpus_for_target,
)


def model_units(preset: str):
    cfg = MODEL_PRESETS[preset]()
    with torch.device("meta"):
        model = CausalLM(cfg)
    return cfg, [(n, tuple(p.shape), u) for n, p, u in param_units(model)]


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="cadenza bench muon-cost", description=__doc__)
    ap.add_argument("--preset", default="k2", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--gpus", type=int, default=256, help="GPU count to break down")
    ap.add_argument("--target", type=float, default=0.2, help="target step time, seconds")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense TFLOP/s per GPU")
    ap.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak NS reaches")
    ap.add_argument("--intra-gbps", type=float, default=450.0, help="GB/s per GPU inside a node")
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per GPU across nodes")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--dense-shard", type=int, default=None, help="dense FSDP group size")
    ap.add_argument("--elem-bytes", type=int, default=2, help="bytes per element sent (bf16=2)")
    args = ap.parse_args(argv)
    hw = Hardware(
        peak_flops=args.peak_tflops * 1e12,
        ns_efficiency=args.efficiency,
        gpus_per_node=args.gpus_per_node,
        intra_node_bw=args.intra_gbps * 1e9,
        inter_node_bw=args.inter_gbps * 1e9,
    )
    cfg, named = model_units(args.preset)
    muon_params = [(n, s, u) for n, s, u in named if u.kind != "adamw"]
    params = [(s, u) for _, s, u in muon_params]
    total_params = sum(torch.Size(s).numel() for _, s, _ in muon_params)
    print(
        f"{args.preset}: {total_params / 1e9:.1f}B parameters under Muon, "
        f"{sum(len(u.unit_shapes(s)) for _, s, u in muon_params):,} natural units"
    )
    print(
        f"hardware: {hw.peak_flops / 1e12:.0f} TFLOP/s x {hw.ns_efficiency:.0%}, "
        f"{hw.intra_node_bw / 1e9:.0f} GB/s intra-node, {hw.inter_node_bw / 1e9:.0f} GB/s inter-node"
    )
    kw = dict(dense_shard=args.dense_shard, elem_bytes=args.elem_bytes)
    one = best_layout(params, args.gpus, hw, **kw)
    print(describe(one))
    n, table = gpus_for_target(params, args.target, hw, **kw)
    print(f"scan for a {args.target * 1e3:.0f} ms step:")
    for c in table:
        print("  " + describe(c))
    if n is None:
        print(f"no GPU count up to {table[-1].gpus} reaches {args.target} s")
    else:
        last = table[-1]
        print(
            f"{n} GPUs reach {last.total_s * 1e3:.0f} ms <= {args.target * 1e3:.0f} ms; "
            f"dominant term: {last.dominant}"
        )
    return {
        "preset": args.preset,
        "hardware": asdict(hw),
        "at_gpus": {
            "gpus": one.gpus,
            "total_s": one.total_s,
            "compute_s": one.compute_s,
            "comm_s": one.comm_s,
            "exposed_s": one.exposed_s,
            "dominant": one.dominant,
        },
        "gpus_for_target": n,
        "target_s": args.target,
        "scan": [{"gpus": c.gpus, "total_s": c.total_s, "dominant": c.dominant} for c in table],
    }
